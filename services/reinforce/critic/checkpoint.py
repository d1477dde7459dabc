"""The critic's checkpoints: written and rotated as the trainer's are (core/checkpoints.py), read back exactly.

critic_checkpoints/step-000010/
    model.safetensors   value model (body and head)
    optimizer.pt        AdamW state: tensors and numbers only, read back with torch.load(weights_only=True)
    rng.pt              torch RNG state(s)
    critic_state.json   {"step": ..., "train_steps": ...}
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from reinforce.core.checkpoints import commit_checkpoint, start_checkpoint

SET_ASIDE = "set-aside"  # checkpoints a restore went back past, kept for the user to inspect or delete


def save_checkpoint(
    root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_steps: int, keep: int
) -> Path:
    """A crash leaves the old checkpoints and no half-written one (core/checkpoints.py stages and renames)."""
    staging = start_checkpoint(root, step)
    save_model(model, str(staging / "model.safetensors"))
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, staging / "rng.pt")
    (staging / "critic_state.json").write_text(json.dumps({"step": step, "train_steps": train_steps}))
    return commit_checkpoint(staging, keep)


def set_aside(checkpoint: Path) -> Path:
    """Move a checkpoint folder into `set-aside/` beside it, under a name no other move can take; the new path."""
    target = checkpoint.parent / SET_ASIDE / f"{checkpoint.name}-{time.time_ns()}"
    target.parent.mkdir(exist_ok=True)
    os.replace(checkpoint, target)
    return target


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Restore model, optimizer and RNG exactly; returns critic_state.json."""
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "critic_state.json").read_text())
