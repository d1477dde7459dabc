"""The trainer's samples table (core/samples.py): a few of the step's samples with their reward, advantage and KL,
to RUN_DIR/samples/ and every tracker. The main rank's, from its share of the step's batch."""

from __future__ import annotations

from typing import Any

from reinforce.core.records_pb2 import Sample
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import pick_samples, write_samples
from reinforce.core.spec import RunSpec
from reinforce.core.trackers import Trackers
from reinforce.trainer.algorithms.base import SampleValues
from reinforce.trainer.batch import StepBatch


def log_samples(
    spec: RunSpec,
    paths: RunPaths,
    trackers: Trackers | None,
    step: int,
    batch: StepBatch,
    sample_values: SampleValues | None,
) -> None:
    """Every logging.samples_every steps: the step's samples file and tracker tables. `sample_values`: the update's
    (None when the step was skipped: no advantage or KL was computed)."""
    every = spec.logging.samples_every
    if every == 0 or step % every:
        return
    rows = sample_rows(step, batch, sample_values, spec.logging.num_samples)
    write_samples(paths, step, rows)
    if trackers is not None:
        trackers.log_samples(step, rows)


def sample_rows(step: int, batch: StepBatch, values: SampleValues | None, n: int) -> list[dict[str, Any]]:
    samples = [(g, s) for g in batch.groups for s in g.samples]
    kept = batch.keep.reshape(-1).tolist()
    rows = []
    for i, pick in pick_samples([s.reward for _, s in samples], n):
        group, sample = samples[i]
        trained = values is not None and kept[i]
        rows.append(
            {
                "step": step,
                "pick": pick,
                "prompt_id": group.prompt_id,
                "prompt": group.prompt_text,
                "response": sample.text,
                "reward": sample.reward,
                "advantage": values.advantage[i].item() if trained else None,
                "kl": values.kl[i].item() if trained else None,
                "response_tokens": len(sample.token_ids),
                "is_end": sample.is_end,
                **_episode_columns(sample),
            }
        )
    return rows


def _episode_columns(sample: Sample) -> dict[str, int]:
    """A multi-turn sample's turns, tool calls and the tools' tokens in `response` (not trained: loss mask 0)."""
    if not sample.loss_mask:
        return {}
    return {
        "turns": sample.turns,
        "tool_calls": sample.tool_calls,
        "tool_tokens": len(sample.loss_mask) - sum(sample.loss_mask),
    }
