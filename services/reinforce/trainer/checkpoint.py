"""Trainer checkpoints: a folder per step, written to a temporary name and renamed, the last K kept.

checkpoints/step-000010/
    model.safetensors    policy weights (safetensors)
    optimizer.pt         optimizer and scheduler state (tensors and numbers; read with weights_only=True)
    rng.pt               torch RNG state
    trainer_state.json   step, data cursor, published weight version
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

_PREFIX = "step-"


@dataclass
class TrainerState:
    step: int  # steps completed
    cursor: dict[str, Any]
    weight_version: int


def save_checkpoint(
    root: Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep: int,
) -> Path:
    final = root / f"{_PREFIX}{state.step:06d}"
    tmp = root / f".tmp-{_PREFIX}{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainerState:
    load_model(model, str(path / "model.safetensors"))
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))
