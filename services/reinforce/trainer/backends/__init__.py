"""Trainer backends behind one interface (base.py), chosen by `training.backend` (core/registry.py's names)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reinforce.core.optional import require_backend
from reinforce.core.registry import BackendName
from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.distributed import Ranks

BackendFactory = Callable[[TrainingSpec, Path, Ranks], TrainerBackend]


# Each imports its backend when called, so that a backend's package is needed only where it is used.
def _torch(training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> TrainerBackend:
    from reinforce.trainer.backends.torch_backend import TorchBackend

    return TorchBackend(training, policy_dir, ranks)


def _megatron(training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> TrainerBackend:
    from reinforce.trainer.backends.megatron.backend import MegatronBackend

    return MegatronBackend(training, policy_dir, ranks)


BACKENDS: dict[BackendName, BackendFactory] = {"torch": _torch, "megatron": _megatron}


def build_backend(training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> TrainerBackend:
    """The backend the spec names."""
    require_backend(training.backend)
    return BACKENDS[training.backend](training, policy_dir, ranks)
