"""Training samples: what the model actually wrote, a few per step (RUN_DIR/samples/step-NNNNNN.jsonl).

The reward alone hides reward hacking; reading responses shows it. Every `logging.samples_every` steps the trainer's
main rank writes `logging.num_samples` of the step's samples, picked so that a run's files compare: the best and
the worst by reward, then the step's first ones. One JSON object per line, with the keys of SAMPLE_KEYS: `pick`
says why the sample was picked (best, worst, first); `advantage` is the sample's advantage (for estimators with one
per token, PPO's GAE and reinforce_plus_plus, its mean over the response); `kl` the sample's KL to the reference
(the configured estimator, the mean over its tokens); both are null for a sample left out of the step (a
non-finite reward). The step is the metrics.jsonl row's: samples of step s were drawn with weight version s - 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from reinforce.core.durable import write_text_atomically
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import SpecError

SAMPLE_KEYS = (
    "step", "pick", "prompt_id", "prompt", "response", "reward", "advantage", "kl", "response_tokens", "is_end",
)  # fmt: skip
PICKS = ("best", "worst", "first")


def pick_samples(rewards: Sequence[float], n: int) -> list[tuple[int, str]]:
    """(index, pick) of up to `n` samples: the best and the worst by finite reward (the first of equals), then the
    first others in order."""
    finite = [i for i, r in enumerate(rewards) if math.isfinite(r)]
    picks: list[tuple[int, str]] = []
    if finite:
        best = max(finite, key=lambda i: rewards[i])
        worst = min(finite, key=lambda i: rewards[i])
        picks = [(best, "best")] + ([(worst, "worst")] if worst != best else [])
    taken = {i for i, _ in picks}
    picks += [(i, "first") for i in range(len(rewards)) if i not in taken]
    return picks[:n]


def write_samples(paths: RunPaths, step: int, rows: list[dict[str, Any]]) -> None:
    """Replace the step's file (a step redone after a resume overwrites its earlier life's)."""
    paths.samples.mkdir(parents=True, exist_ok=True)
    write_text_atomically(paths.samples_file(step), samples_jsonl(rows))


def samples_jsonl(rows: list[dict[str, Any]]) -> str:
    """The rows as JSON lines, NaN and inf as null (json.dumps would write a bare NaN, which is not JSON)."""
    return "".join(json.dumps({k: _finite_or_none(v) for k, v in row.items()}) + "\n" for row in rows)


def sample_steps(paths: RunPaths) -> list[int]:
    """The steps that have a samples file (step-NNNNNN.jsonl; other names are not the trainer's), in order."""
    names = (p.stem.removeprefix("step-") for p in paths.samples.glob("step-*.jsonl"))
    return sorted(int(name) for name in names if name.isdigit())


def read_samples(paths: RunPaths, step: int) -> list[dict[str, Any]]:
    """The step's samples; SpecError naming the file (and line) where it is not a regular file of sample rows."""
    path = paths.samples_file(step)
    if not path.is_file():  # a FIFO or a device would block the read, or never end it
        raise SpecError(f"{path}: not a regular file")
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise SpecError(f"{path}:{number}: not a JSON line ({err})") from None
        missing = [key for key in SAMPLE_KEYS if not isinstance(row, dict) or key not in row]
        if missing:
            raise SpecError(f"{path}:{number}: not a sample row (missing {', '.join(missing)})")
        rows.append(row)
    return rows


def discard_samples_after(paths: RunPaths, step: int) -> None:
    """A resume redoes the steps after its checkpoint: their files from the earlier life go, so that a run stopped
    before it redid them holds no sample of a step that metrics.jsonl no longer has."""
    for later in sample_steps(paths):
        if later > step:
            paths.samples_file(later).unlink(missing_ok=True)


def format_sample(row: dict[str, Any], max_chars: int | None = None) -> str:
    """A sample for people: its numbers on one line, then the prompt and the response (JSON-quoted, so that
    whitespace and newlines show), each cut to `max_chars`."""
    ended = "ended" if row["is_end"] else "cut at max_new_tokens"
    head = (
        f"step {row['step']} {row['pick']}: reward {_number(row['reward'], '.4f')}  "
        f"advantage {_number(row['advantage'], '+.4f')}  KL {_number(row['kl'], '.4f')}  "
        f"{row['response_tokens']} tokens ({ended})"
    )
    if "turns" in row:  # a multi-turn episode
        head += f", {row['turns']} turns, {row['tool_calls']} tool calls ({row['tool_tokens']} tools' tokens)"
    return f"{head}\n  prompt:   {_quoted(row['prompt'], max_chars)}\n  response: {_quoted(row['response'], max_chars)}"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _quoted(text: str, max_chars: int | None) -> str:
    if max_chars is not None and len(text) > max_chars:
        return json.dumps(text[:max_chars]) + f" ... ({len(text)} characters)"
    return json.dumps(text)


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
