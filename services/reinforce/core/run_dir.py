"""The layout of a run folder, shared by every process of a run."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from reinforce.core.durable import write_text_atomically


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def spec(self) -> Path:
        """The resolved spec every service reads (absolute paths)."""
        return self.root / "spec.yaml"

    @property
    def initial_policy(self) -> Path:
        """Hugging Face folder of the initial policy: weight version 0 and the reference."""
        return self.root / "initial_policy"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def critic_checkpoints(self) -> Path:
        """The PPO critic's checkpoints, one per trainer checkpoint (the same step)."""
        return self.root / "critic_checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def trained_groups(self) -> Path:
        """One line per step: the prompt ids of the groups it trained on (an exactly-once audit trail)."""
        return self.root / "trained_groups.jsonl"

    @property
    def plot(self) -> Path:
        return self.root / "reward_kl.png"

    @property
    def final_model(self) -> Path:
        """The trained policy in Hugging Face format."""
        return self.root / "final_model"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def training_api(self) -> Path:
        """`reinforce serve`'s folder: its API key (api_key, private) and the tinker:// checkpoints."""
        return self.root / "training_api"

    @property
    def lock(self) -> Path:
        """Held (flock) by the live supervisor of this folder, and holding its PID."""
        return self.root / "supervisor.lock"

    @property
    def run_id(self) -> Path:
        """The run's random id, written by the trainer's first life; every checkpoint's manifest names it."""
        return self.root / "run_id"

    @property
    def validation(self) -> Path:
        """validation/step-NNNNNN.jsonl: a few validation responses of each evaluation."""
        return self.root / "validation"

    @property
    def samples(self) -> Path:
        """samples/step-NNNNNN.jsonl: a few of each step's training samples (logging.samples_every)."""
        return self.root / "samples"

    def samples_file(self, step: int) -> Path:
        return self.samples / f"step-{step:06d}.jsonl"

    @property
    def outcome(self) -> Path:
        """outcome.json: how the last `reinforce run` of this folder ended (exit code, error): `reinforce status`."""
        return self.root / "outcome.json"

    @property
    def trackers(self) -> Path:
        """Experiment trackers' folders: tensorboard/, wandb/, mlruns/ (logging.trackers)."""
        return self.root

    def partial_files(self) -> list[Path]:
        """What an interrupted write (a crash, a full disk) leaves: weight versions, checkpoints and files written
        under a temporary name, never read by anything. Safe to delete while no component runs."""
        patterns = (
            (self.root, ".*.tmp"),  # durable.write_text_atomically's (prometheus_targets.json, metrics.jsonl)
            (self.samples, ".*.tmp"),
            (self.weights, "*.tmp"),
            (self.checkpoints, ".tmp-*"),
            (self.critic_checkpoints, ".tmp-*"),
        )
        return sorted(path for folder, pattern in patterns for path in folder.glob(pattern))

    def remove_partial_files(self) -> None:
        for path in self.partial_files():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def ensure_run_id(paths: RunPaths) -> str:
    """The run's id (RunPaths.run_id), created on first use: by the supervisor before it starts anything, by the
    trainer's main process on a cluster."""
    if paths.run_id.exists():
        return paths.run_id.read_text().strip()
    run_id = uuid.uuid4().hex
    paths.root.mkdir(parents=True, exist_ok=True)
    write_text_atomically(paths.run_id, run_id + "\n")
    return run_id
