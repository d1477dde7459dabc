"""Trainer backends behind one interface (base.py), chosen by `training.backend`."""

from __future__ import annotations

from pathlib import Path

from reinforce.core.spec import TrainingSpec
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.distributed import Ranks


def build_backend(training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> TrainerBackend:
    """The backend the spec names; imported here so that a backend's package is needed only where it is used."""
    if training.backend == "torch":
        from reinforce.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(training, policy_dir, ranks)
    if training.backend == "megatron":
        try:
            from reinforce.trainer.backends.megatron.backend import MegatronBackend
        except ImportError as err:
            raise RuntimeError(
                f"training.backend megatron needs megatron-core: pip install 'reinforce-k8s[megatron]' ({err})"
            ) from None
        return MegatronBackend(training, policy_dir, ranks)
    raise ValueError(f"training.backend {training.backend!r} is not available")
