"""Generation engines behind one interface (base.py), chosen by `generation.engine`."""

from __future__ import annotations

from pathlib import Path

from reinforce.core.optional import require_engine
from reinforce.core.spec import GenerationSpec, LoraSpec
from reinforce.generator.engines.base import GenerationEngine


def build_engine(
    generation: GenerationSpec, policy_dir: Path, num_samples: int, lora: LoraSpec | None = None
) -> GenerationEngine:
    """The engine the spec names; imported here so that an engine's package is needed only where it is used.

    `lora`: the run's training.lora. The vLLM engine then starts with its LoRA support on; the torch engine needs
    nothing in advance (it merges each version into its weights)."""
    require_engine(generation.engine)
    if generation.engine == "vllm":
        from reinforce.generator.engines.vllm_engine import VLLMEngine

        return VLLMEngine(policy_dir, generation, num_samples, lora=lora)
    if generation.engine == "tensorrt_llm":
        from reinforce.generator.engines.tensorrt_llm_engine import TensorRTLLMEngine

        return TensorRTLLMEngine(policy_dir, generation, num_samples)
    from reinforce.generator.engines.torch_engine import TorchEngine

    return TorchEngine(policy_dir, generation, num_samples)
