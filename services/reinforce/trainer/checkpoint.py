"""Trainer checkpoints: a folder per step, written to a temporary name and renamed, the last K kept.

checkpoints/step-000010/
    ...                  the backend's state: for the torch backend model.safetensors (policy weights) and
                         optimizer.pt (optimizer and scheduler state; read with weights_only=True); for the
                         megatron backend one file per shard (backends/megatron/checkpoint.py)
    rng.pt               torch RNG state
    trainer_state.json   step, data cursor, published weight version
    manifest.json        written last: the run's id (RUN_DIR/run_id) and each other file's size and sha256

A resume takes the newest checkpoint whose files match its manifest: a damaged one (a truncated or changed file,
no manifest) is renamed damaged-step-NNNNNN, logged naming the file, and the one before is used. A checkpoint
whose manifest names another run is refused, naming both run ids: its files belong to another history. Writing,
renaming and the rotation (`keep`) are core/checkpoints.py's, shared with the critic: the rotation runs after a
checkpoint is written, hashed and durable, and deletes only older ones, so the newest known-good one is kept.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reinforce.core.checkpoints import (
    checkpoint_folder,
    commit_checkpoint,
    damage,
    list_checkpoints,
    refuse_foreign_checkpoints,
    staging_folder,
    start_checkpoint,
)
from reinforce.core.durable import replace_durably
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.distributed import Ranks

log = logging.getLogger(__name__)
_DAMAGED = "damaged-"


@dataclass
class TrainerState:
    step: int  # steps completed
    cursor: dict[str, Any]
    weight_version: int


def save_checkpoint(
    root: Path,
    state: TrainerState,
    backend: TrainerBackend,
    keep: int,
    run_id: str,
    ranks: Ranks | None = None,
) -> Path:
    """Every process calls it; the main one alone unless the backend is sharded (each process writes its part).

    `run_id` (the main process's; others may pass "") goes into the manifest."""
    ranks = ranks or Ranks()
    staging = staging_folder(root, state.step)
    if ranks.is_main:
        start_checkpoint(root, state.step)
    ranks.barrier()
    if backend.sharded or ranks.is_main:
        backend.save_state(staging)
    ranks.barrier()  # every part written before the main process names the folder complete
    if ranks.is_main:
        torch.save({"torch": torch.get_rng_state()}, staging / "rng.pt")
        (staging / "trainer_state.json").write_text(json.dumps(state.__dict__))
        commit_checkpoint(staging, keep, run_id)
    ranks.barrier()
    return checkpoint_folder(root, state.step)


def newest_intact_checkpoint(root: Path, run_id: str, ranks: Ranks | None = None) -> Path | None:
    """The checkpoint to resume from. Every process calls it: the main one checks the checkpoints, newest first,
    setting damaged ones aside (renamed damaged-step-NNNNNN) until one is intact, and refuses one of another run
    (ForeignCheckpoint); then every process takes the newest left."""
    ranks = ranks or Ranks()
    if ranks.is_main:
        refuse_foreign_checkpoints(root, run_id)
        for folder in reversed(list_checkpoints(root)):
            problem = damage(folder)
            if problem is None:
                break
            aside = _set_aside(folder)
            log.error("checkpoint %s is damaged (%s): set aside as %s; trying the one before", folder, problem, aside)
    ranks.barrier()  # every process sees the same checkpoints from here on
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def _set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint out of the rotation's and the resume's sight, keeping it for inspection."""
    aside = folder.with_name(_DAMAGED + folder.name)
    n = 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{_DAMAGED}{folder.name}-{n}")
    replace_durably(folder, aside)
    return aside


def load_checkpoint(path: Path, backend: TrainerBackend) -> TrainerState:
    backend.load_state(path)
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))
