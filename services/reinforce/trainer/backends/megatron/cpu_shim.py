"""Run Megatron-core's GPTModel on a machine without CUDA (tests, CI, laptops).

megatron-core is written for GPUs: a few of its helpers call `torch.cuda` directly even when the model is
built with `use_cpu_initialization=True`. On a CPU-only PyTorch those calls raise "Torch not compiled with
CUDA enabled". :func:`apply_cpu_shim` points exactly those helpers at their CPU equivalents, and only when
CUDA is absent, so the same code runs unchanged on a GPU node. It is idempotent.

What still needs CUDA (allocations hard-coded to device="cuda", checked with megatron-core 0.16.1): Megatron's
optimizer wrappers (`get_megatron_optimizer`: FP32Optimizer, DistributedOptimizer) and `clip_grads`, its
pipeline schedules (`get_forward_backward_func`, even without pipelining), and tied embeddings with pipeline
parallelism (`weight.data.cuda()` at build). On CPU the backend uses torch's AdamW, its own TP-aware
`model.clip_grad_norm_` and no pipeline parallelism. Megatron's DDP wrapper does build and run here (gloo).
The model must also be configured without the fused kernels: see `convert.CPU_SAFE_CONFIG`.
"""

from __future__ import annotations

import functools

import torch

_APPLIED_MARK = "_reinforce_cpu_shim"


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_get_rng_state(*_args: object, **_kwargs: object) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: object, **_kwargs: object) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # Same as megatron.core.transformer.utils.get_default_causal_mask, on the CPU (True = masked out).
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_shim() -> bool:
    """Patch megatron-core's CUDA-only helpers when CUDA is unavailable; True if the shim is (now) active.

    Call it before building a model. On a machine with CUDA it changes nothing and returns False.
    """
    if torch.cuda.is_available():
        return False
    if getattr(torch.cuda, _APPLIED_MARK, False):
        return True  # already applied: patching twice would wrap nothing new, but keep it a no-op

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils

    # Buffers, rotary frequencies and gathered tensors are allocated on `device=torch.cuda.current_device()`;
    # "cpu" is a valid `device=` argument everywhere megatron-core uses it on the model's path.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]  # str, not int: see above
    # The RNG tracker saves and restores "the CUDA RNG" around dropout; on CPU the ops draw from the CPU
    # generator, so that is the state to save, fork and restore (keeps dropout reproducible per TP rank).
    torch.cuda.get_rng_state = _cpu_get_rng_state
    # Same reason: the tracker restores the saved state after each fork.
    torch.cuda.set_rng_state = _cpu_set_rng_state
    # model_parallel_cuda_manual_seed seeds "the CUDA generator" per rank; seed the CPU one instead.
    torch.cuda.manual_seed = _cpu_manual_seed
    # The tracker's fork() calls these module-level helpers (not torch.cuda) to get and set the state.
    tp_random._get_cuda_rng_state = _cpu_get_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_rng_state
    # The unfused softmax builds its default causal mask with device="cuda"; fused_softmax imported the
    # function by name, so patch both the definition and that binding.
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask

    setattr(torch.cuda, _APPLIED_MARK, True)
    return True
