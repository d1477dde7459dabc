"""Optional packages (engines, backends, trackers): a feature whose package is missing is refused when the run
starts, saying what needs it and how to install it, not by a component that dies later. Which choice needs which
package: core/registry.py."""

from __future__ import annotations

import importlib.util

from reinforce.core.registry import BACKEND_PACKAGES, ENGINE_PACKAGES, BackendName, EngineName, Package


class MissingPackage(RuntimeError):
    """A configured feature whose Python package is not installed."""


def require_package(module: str, needed_by: str, how: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted module whose parent package is missing
        found = False
    if not found:
        raise MissingPackage(f"{needed_by} needs the Python package {module!r}, which is not installed: {how}")


def _require(package: Package | None, needed_by: str) -> None:
    if package is not None:
        require_package(package.module, needed_by, package.install)


def require_engine(engine: EngineName) -> None:
    """Refuse a generation engine whose package is missing (the torch engine needs nothing more)."""
    _require(ENGINE_PACKAGES.get(engine), f"generation.engine {engine}")


def require_backend(backend: BackendName) -> None:
    """Refuse a trainer backend whose package is missing (the torch backend needs nothing more)."""
    _require(BACKEND_PACKAGES.get(backend), f"training.backend {backend}")
