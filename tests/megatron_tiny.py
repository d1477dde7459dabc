"""The tiny Llama policies and the batch the Megatron backend's tests share (the torchrun worker uses them too),
and `megatron_parallel_state`: Megatron's parallel state in a pytest process, with the CPU shim undone after."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.trainer.backends.megatron import convert
from reinforce.trainer.backends.megatron.model import load_hf_state_dict, response_logprobs

# Ragged prompts and responses: padding on the right of different widths, a one-token prompt and response.
PROMPTS = [[1, 5, 6, 7, 8], [2, 3], [9], [4, 4, 4, 30, 31, 32]]
RESPONSES = [[10, 11, 12], [13, 14, 15, 16, 17, 18], [40], [20, 21, 2]]
ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, -1.0])
TEMPERATURE = 0.7


def tiny_config(*, vocab: int = 41, tied: bool = True, kv_heads: int = 2, rope_theta: float = 1e4) -> LlamaConfig:
    """GQA (4 query heads over 2 KV groups), SwiGLU, 2 layers; vocab 41 is odd, so TP=2 pads it."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=0,
    )


def tiny_hf_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """A random model whose log-probs are far from uniform (HF's 0.02 init gives near-constant ones)."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32: LlamaConfig's default dtype
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm gains around 1, not all exactly 1
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
    return model.eval()


def megatron_from_hf(hf_model: LlamaForCausalLM, tensor_parallel_size: int) -> tuple[Any, convert.LlamaLayout]:
    """This rank's GPTModel with the HF model's weights (parallel state already initialised)."""
    layout = convert.layout_from_hf(hf_model.config, tensor_parallel_size)
    config = convert.transformer_config_from_hf(hf_model.config, tensor_parallel_size=tensor_parallel_size)
    model = convert.build_gpt_model(hf_model.config, config, layout=layout)
    load_hf_state_dict(model, hf_model.state_dict(), layout)
    return model, layout


def policy_loss(model: Any) -> torch.Tensor:
    """The REINFORCE loss on the shared batch: -(masked token mean of log pi * advantage)."""
    logprobs, mask = response_logprobs(model, PROMPTS, RESPONSES, TEMPERATURE)
    return -(logprobs * ADVANTAGES[:, None] * mask).sum() / mask.sum()


@contextmanager
def megatron_parallel_state(tensor_parallel_size: int = 1) -> Iterator[None]:
    """One process's Megatron parallel state (an in-memory gloo group: no port, no torchrun).

    The CPU shim patches torch.cuda and megatron helpers process-wide; they are put back on exit, so tests that
    run later in the same pytest process see an unpatched torch.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils

    from reinforce.trainer.backends.megatron import cpu_shim
    from reinforce.trainer.backends.megatron.model import destroy_parallel, initialize_parallel

    patched = {
        torch.cuda: ["current_device", "get_rng_state", "set_rng_state", "manual_seed"],
        tp_random: ["_get_cuda_rng_state", "_set_cuda_rng_state"],
        transformer_utils: ["get_default_causal_mask"],
        fused_softmax: ["get_default_causal_mask"],
    }
    saved = {(module, name): getattr(module, name) for module, names in patched.items() for name in names}
    cpu_state = torch.get_rng_state()
    initialize_parallel(tensor_parallel_size=tensor_parallel_size, seed=1234)
    try:
        yield
    finally:
        destroy_parallel()
        for (module, name), value in saved.items():
            setattr(module, name, value)
        if hasattr(torch.cuda, cpu_shim._APPLIED_MARK):
            delattr(torch.cuda, cpu_shim._APPLIED_MARK)
        torch.set_rng_state(cpu_state)  # the shim's manual_seed reseeded the CPU generator


# megatron-core says so at every import on a machine without Apex/Transformer Engine; the CPU path needs neither.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
