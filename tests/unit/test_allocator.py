"""training.allocator: the trainer starts itself again with jemalloc preloaded (trainer/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reinforce.trainer.allocator import AllocatorError, preload_environment

LIBRARY = "libjemalloc.so.2"


def test_jemalloc_is_preloaded_keeping_the_users_own_preload():
    environ = preload_environment("jemalloc", {"LD_PRELOAD": "libmine.so", "A": "1"}, LIBRARY, loaded=False)
    assert environ == {"LD_PRELOAD": f"{LIBRARY} libmine.so", "A": "1"}
    assert preload_environment("jemalloc", {}, LIBRARY, loaded=False) == {"LD_PRELOAD": LIBRARY}


@pytest.mark.parametrize(("choice", "loaded"), [("system", False), ("jemalloc", True)])
def test_the_system_allocator_or_jemalloc_already_loaded_go_on_as_they_are(choice, loaded):
    assert preload_environment(choice, {}, LIBRARY, loaded) is None


@pytest.mark.parametrize(
    ("environ", "library"),
    [({}, None), ({"LD_PRELOAD": "/gone/libjemalloc.so.2"}, LIBRARY)],  # not installed; preloaded and failed: no loop
)
def test_jemalloc_that_is_missing_or_does_not_load_is_refused_naming_the_field(environ, library):
    with pytest.raises(AllocatorError, match=r"training\.allocator is jemalloc.*libjemalloc2"):
        preload_environment("jemalloc", environ, library, loaded=False)


REPORT = (
    "import os, sys\n"
    "from reinforce.trainer.allocator import use_allocator, jemalloc_loaded\n"
    "use_allocator(sys.argv[1])\n"
    "print(os.getpid(), jemalloc_loaded(), sys.argv[1:])\n"
)


def started(choice: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """A process that calls use_allocator(choice) and reports: (its exit code, its stdout, its stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-c", REPORT, choice, "--flag"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    out, err = process.communicate(timeout=60)
    if process.returncode == 0:
        pid, out = out.split(" ", 1)
        assert int(pid) == process.pid  # the same process, started again
    return process.returncode, out.strip(), err


def test_a_real_process_starts_again_with_jemalloc_same_pid_and_arguments():
    # libjemalloc2 comes with `make install` (pyproject.toml's apt list)
    assert started("jemalloc")[:2] == (0, "True ['jemalloc', '--flag']")
    assert started("system")[:2] == (0, "False ['system', '--flag']")


def test_a_preload_that_fails_is_refused_not_retried():
    code, _, err = started("jemalloc", {**os.environ, "LD_PRELOAD": "/gone/libjemalloc.so.2"})
    assert code != 0 and "training.allocator is jemalloc" in err
