"""Trainer checkpoints: a folder per step, written to a temporary name and renamed, the last K kept.

checkpoints/step-000010/
    ...                  the backend's state: for the torch backend model.safetensors (policy weights) and
                         optimizer.pt (optimizer and scheduler state; read with weights_only=True); for the
                         megatron backend one file per shard (backends/megatron/checkpoint.py)
    rng.pt               torch RNG state
    trainer_state.json   step, data cursor, published weight version
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reinforce.core.durable import fsync_tree, replace_durably
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.distributed import Ranks

_PREFIX = "step-"


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
    ranks: Ranks | None = None,
) -> Path:
    """Every process calls it; the main one alone unless the backend is sharded (each process writes its part)."""
    ranks = ranks or Ranks()
    final = root / f"{_PREFIX}{state.step:06d}"
    tmp = root / f".tmp-{_PREFIX}{state.step:06d}"
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()
    if backend.sharded or ranks.is_main:
        backend.save_state(tmp)
    ranks.barrier()  # every part written before the main process names the folder complete
    if ranks.is_main:
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__))
        fsync_tree(tmp)  # the data on disk before the name that promises it is complete
        shutil.rmtree(final, ignore_errors=True)
        replace_durably(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()
    return final


def list_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())


def load_checkpoint(path: Path, backend: TrainerBackend) -> TrainerState:
    backend.load_state(path)
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))
