"""Whether this machine computes in bfloat16 natively: where `training.precision` and `generation.dtype` auto pick
bfloat16 and where float32.

bfloat16 pays only where the hardware multiplies it: an x86 CPU with AMX or AVX512-BF16 (Sapphire Rapids and later,
Cooper Lake, AMD Zen 4 and later), a GPU of compute capability 8.0 or higher. Elsewhere torch and vLLM emulate it,
converting to float32 around each product, and a bfloat16 run is slower than a float32 one: on such a CPU
benchmarks/vs_trl.py's bfloat16 matmul peak is below its float32 one (on the machines of BENCHMARKS.md's TRL section
it is three times higher). Other CPU architectures count as not native: torch reports no bfloat16 capability for
them.
"""

from __future__ import annotations

import torch

CPU_BFLOAT16_CAPABILITIES = ("amx_bf16", "avx512_bf16")


def bfloat16_is_native(device: str | None = None) -> bool:
    """Whether `device` ("cpu" or "cuda"; None: the GPU where torch sees one, else the CPU) multiplies bfloat16 in
    hardware."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(name, False) for name in CPU_BFLOAT16_CAPABILITIES)
