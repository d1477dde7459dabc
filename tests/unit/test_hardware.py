"""core/hardware.py: bfloat16 counts as native where the CPU has AMX or AVX512-BF16, or the GPU is Ampere or later."""

from pathlib import Path

import pytest
import torch

from reinforce.core import hardware
from reinforce.core.hardware import bfloat16_is_native


@pytest.mark.parametrize(
    ("capabilities", "native"),
    [
        ({"amx_bf16": True, "avx512_bf16": False}, True),  # Sapphire Rapids and later
        ({"amx_bf16": False, "avx512_bf16": True}, True),  # Cooper Lake, Zen 4
        ({"amx_bf16": False, "avx512_bf16": False, "avx512_f": True}, False),  # AVX512 alone: emulated
        ({"architecture": "aarch64"}, False),  # torch names no bfloat16 capability there
    ],
)
def test_the_cpu_counts_by_its_bfloat16_capabilities(monkeypatch, capabilities, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert bfloat16_is_native("cpu") is native


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the kernel's CPU flags")
def test_this_cpu_agrees_with_the_kernels_flags():
    """What torch reports against what the kernel does: the probe reads no stale or misnamed capability."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert bfloat16_is_native("cpu") == bool(flags & set(hardware.CPU_BFLOAT16_CAPABILITIES))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_the_machine_is_its_cpu():
    assert bfloat16_is_native("cuda") is False
    assert bfloat16_is_native() == bfloat16_is_native("cpu")
