"""The trainer's memory allocator (training.allocator): the C library's malloc, or jemalloc.

A step's tensors change size with every micro-batch (sequences sorted by length under a token budget). The C
library's malloc keeps freed blocks that it then cannot reuse for the next sizes, and the process's resident memory
outgrows what its live tensors hold. jemalloc holds less because it keeps returning freed pages to the system, and
the step pays for faulting them in again: a trade for runs that meet a memory limit, not a default (BENCHMARKS.md,
Long responses). An allocator is chosen before a process starts (LD_PRELOAD), so the trainer starts itself again,
once, with jemalloc preloaded: the same process id, arguments and environment, so a supervisor, a pod or torchrun
sees nothing change.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

JEMALLOC = "jemalloc"


class AllocatorError(RuntimeError):
    """training.allocator asks for an allocator this machine does not have."""


def jemalloc_library() -> str | None:
    """The installed jemalloc's library name (libjemalloc.so.2 on Debian), as the dynamic loader finds it."""
    return ctypes.util.find_library(JEMALLOC)


def jemalloc_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether jemalloc is mapped into this process."""
    return "libjemalloc" in maps.read_text()


def preload_environment(
    choice: str, environ: dict[str, str], library: str | None, loaded: bool
) -> dict[str, str] | None:
    """The environment to start again with, jemalloc preloaded; None when this process should go on as it is.

    Nothing to do under `system`, or when jemalloc is already loaded. LD_PRELOAD already naming it (a start that
    preloaded it and failed) is refused rather than tried again, so the trainer cannot loop. A user's own
    LD_PRELOAD is kept.
    """
    if choice == "system" or loaded:
        return None
    preloaded = environ.get("LD_PRELOAD", "")
    if library is None or JEMALLOC in preloaded:
        raise AllocatorError(
            "training.allocator is jemalloc, but libjemalloc.so.2 is not installed or does not load "
            f"(LD_PRELOAD {preloaded!r}; Debian: apt-get install libjemalloc2), or set training.allocator: system"
        )
    return {**environ, "LD_PRELOAD": f"{library} {preloaded}".strip()}


def use_allocator(choice: str) -> None:
    """Start this process again with jemalloc preloaded when `choice` (training.allocator) asks for it and it is
    not loaded yet; otherwise return. Call it first, before the process opens ports or files it would keep."""
    if choice == "system":  # the default: no library lookup (ldconfig) or /proc read at every trainer start
        return
    environ = preload_environment(choice, dict(os.environ), jemalloc_library(), jemalloc_loaded())
    if environ is None:
        if choice == JEMALLOC:
            log.info("memory allocator: jemalloc")
        return
    log.info("starting again with %s preloaded (training.allocator jemalloc)", environ["LD_PRELOAD"].split()[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
