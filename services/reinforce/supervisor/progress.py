"""What `reinforce run` shows of the training: the progress bar while it runs and the summary when it is done, both
from the trainer's metrics.jsonl."""

from __future__ import annotations

from tqdm import tqdm

from reinforce.core.metrics import read_metrics, shown
from reinforce.core.run_dir import RunPaths
from reinforce.supervisor.samples import print_samples_summary


class Progress:
    """The progress bar, fed from metrics.jsonl (re-read only when the trainer has appended to it)."""

    def __init__(self, paths: RunPaths, total_steps: int) -> None:
        self.paths = paths
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._size = 0

    def update(self) -> None:
        size = self.paths.metrics.stat().st_size if self.paths.metrics.exists() else 0
        if size == self._size:
            return
        self._size = size
        rows = read_metrics(self.paths.metrics)
        if not rows:  # a restarted trainer dropped the rows of the steps it redoes
            self.bar.reset()
            return
        rows = [r for r in rows if "train_rollouts/rewards" in r]  # not the start's validation-only row
        if not rows:
            return
        last = rows[-1]
        self.bar.update(last["step"] - self.bar.n)
        self.bar.set_postfix(
            reward=shown(last.get("train_rollouts/rewards"), ".3f"),
            kl=shown(last.get("train_rollouts/init_policy_kl"), ".4f"),
            tok_s=shown(last.get("throughput/generated_tokens_per_second"), ".0f"),
        )

    def close(self) -> None:
        self.bar.close()


def print_summary(paths: RunPaths) -> None:
    rows = [r for r in read_metrics(paths.metrics) if "train_rollouts/rewards" in r]
    if not rows:
        return
    first, last = rows[0], rows[-1]
    print(
        f"done: {last['step']} steps; reward {shown(first.get('train_rollouts/rewards'), '.3f')} -> "
        f"{shown(last.get('train_rollouts/rewards'), '.3f')}; "
        f"KL {shown(last.get('train_rollouts/init_policy_kl'), '.4f')}\n"
        f"  metrics {paths.metrics}\n  plot    {paths.plot}\n  model   {paths.final_model}"
    )
    print_samples_summary(paths)
