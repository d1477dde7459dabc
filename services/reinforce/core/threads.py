"""How many CPU threads a process may use, and setting torch's and OpenMP's thread counts from it.

torch starts as many threads as the machine has cores, whatever the process may use: a pod with a CPU limit, a
process pinned to some cores, or two busy processes on one machine each run one thread per core. OpenMP threads
then outnumber the cores they get and spin waiting for each other, and a step takes many times longer. Each
service calls `configure_threads` at start; the count is, first found:

1. `$REINFORCE_NUM_THREADS` (the local supervisor sets it for each process it starts; any user may);
2. the CPUs the process may use: its CPU affinity, capped by its cgroup's CPU quota (v2 `cpu.max`, v1
   `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

THREADS_ENV = "REINFORCE_NUM_THREADS"
# OpenMP threads that wait sleep instead of spinning. On a core shared with another busy process, spinning turns
# every barrier into a contest: with one of 2 cores busy, a bf16 step on SmolLM2 took 84-160 s instead of 14 s;
# with PASSIVE 25 s. On a quiet machine sleeping costs a wake-up at every parallel region, so a local run whose
# processes take turns leaves libgomp's default instead (supervisor/children.py, openmp_environment). The OpenMP
# runtime reads it when it loads, so it is put in a service's environment before the process starts (the
# operator's pods, the supervisor's children where they compute together).
OPENMP_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
CGROUP_ROOT = Path("/sys/fs/cgroup")  # in a container: its own cgroup (cgroup namespace)

log = logging.getLogger(__name__)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU limit in CPUs (quota / period), or None where there is none (or no cgroup file)."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, period = v2.read_text().split()[:2]  # "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        quota_file = v1 / "cpu.cfs_quota_us"
        if quota_file.is_file():
            quota = int(quota_file.read_text())
            return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    return None


def usable_cpus(affinity: set[int] | None = None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: its affinity (default: the process's own), capped by the cgroup quota."""
    cpus = len(affinity if affinity is not None else os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(cpus, 1)


def thread_count(environ: dict[str, str] | os._Environ = os.environ, cgroup_root: Path = CGROUP_ROOT) -> int:
    """The explicit $REINFORCE_NUM_THREADS (a positive integer), else `usable_cpus()`."""
    explicit = environ.get(THREADS_ENV)
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise ValueError(f"${THREADS_ENV} must be a positive integer, got {explicit!r}")
        return int(explicit)
    return usable_cpus(cgroup_root=cgroup_root)


def configure_threads() -> int:
    """Set OMP_NUM_THREADS and, once torch is imported, its intra-op threads to `thread_count()`; the count.

    A torch imported later reads OMP_NUM_THREADS, so a service that may never need torch (the reward server) does
    not import it here; so do child processes."""
    threads = thread_count()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    log.info("using %d CPU threads", threads)
    return threads
