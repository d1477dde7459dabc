"""Generation engines behind one interface (base.py), chosen by `generation.engine` (core/registry.py's names)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reinforce.core.optional import require_engine
from reinforce.core.registry import EngineName
from reinforce.core.spec import GenerationSpec, LoraSpec
from reinforce.generator.engines.base import GenerationEngine

EngineFactory = Callable[[Path, GenerationSpec, int, LoraSpec | None], GenerationEngine]


# Each imports its engine when called, so that an engine's package is needed only where it is used.
def _torch(policy_dir: Path, generation: GenerationSpec, num_samples: int, lora: LoraSpec | None) -> GenerationEngine:
    from reinforce.generator.engines.torch_engine import TorchEngine

    return TorchEngine(policy_dir, generation, num_samples, lora)  # merges each LoRA version into its weights


def _vllm(policy_dir: Path, generation: GenerationSpec, num_samples: int, lora: LoraSpec | None) -> GenerationEngine:
    from reinforce.generator.engines.vllm_engine import VLLMEngine

    return VLLMEngine(policy_dir, generation, num_samples, lora=lora)  # starts with its LoRA support on


def _tensorrt_llm(
    policy_dir: Path, generation: GenerationSpec, num_samples: int, lora: LoraSpec | None
) -> GenerationEngine:
    from reinforce.generator.engines.tensorrt_llm_engine import TensorRTLLMEngine

    return TensorRTLLMEngine(policy_dir, generation, num_samples)


ENGINES: dict[EngineName, EngineFactory] = {"torch": _torch, "vllm": _vllm, "tensorrt_llm": _tensorrt_llm}


def build_engine(
    generation: GenerationSpec, policy_dir: Path, num_samples: int, lora: LoraSpec | None = None
) -> GenerationEngine:
    """The engine the spec names. `lora`: the run's training.lora."""
    engine = generation.resolved_engine()
    require_engine(engine)
    return ENGINES[engine](policy_dir, generation, num_samples, lora)
