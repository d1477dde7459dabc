"""Generation engines behind one interface (base.py), chosen by `generation.engine`."""

from __future__ import annotations

from pathlib import Path

from reinforce.core.spec import GenerationSpec
from reinforce.generator.engines.base import GenerationEngine


def build_engine(generation: GenerationSpec, policy_dir: Path, num_samples: int) -> GenerationEngine:
    """The engine the spec names; imported here so that an engine's package is needed only where it is used."""
    if generation.engine == "torch":
        from reinforce.generator.engines.torch_engine import TorchEngine

        return TorchEngine(policy_dir, generation, num_samples)
    raise ValueError(f"generation.engine {generation.engine!r} is not available")
