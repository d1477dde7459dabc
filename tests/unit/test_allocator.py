"""training.allocator: the trainer starts itself again with jemalloc preloaded (trainer/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reinforce.trainer.allocator import AllocatorError, preload_environment

LIBRARY = "libjemalloc.so.2"


def test_auto_preloads_jemalloc_keeping_the_users_own_preload():
    environ = preload_environment("auto", {"LD_PRELOAD": "libmine.so", "A": "1"}, LIBRARY, loaded=False)
    assert environ == {"LD_PRELOAD": f"{LIBRARY} libmine.so", "A": "1"}
    assert preload_environment("jemalloc", {}, LIBRARY, loaded=False) == {"LD_PRELOAD": LIBRARY}


@pytest.mark.parametrize(
    ("choice", "environ", "library", "loaded"),
    [
        ("system", {}, LIBRARY, False),  # asked for the C library's malloc
        ("auto", {}, LIBRARY, True),  # already running with jemalloc
        ("auto", {}, None, False),  # not installed: auto goes on with malloc
        ("auto", {"LD_PRELOAD": "/gone/libjemalloc.so.2"}, LIBRARY, False),  # preloaded and failed: no loop
    ],
)
def test_cases_that_go_on_as_they_are(choice, environ, library, loaded):
    assert preload_environment(choice, environ, library, loaded) is None


def test_jemalloc_asked_for_and_missing_is_refused_naming_the_field():
    with pytest.raises(AllocatorError, match=r"training\.allocator is jemalloc.*libjemalloc2"):
        preload_environment("jemalloc", {}, None, loaded=False)


REPORT = (
    "import os, sys\n"
    "from reinforce.trainer.allocator import use_allocator, jemalloc_loaded\n"
    "use_allocator(sys.argv[1])\n"
    "print(os.getpid(), jemalloc_loaded(), sys.argv[1:])\n"
)


def started(choice: str, env: dict[str, str] | None = None) -> tuple[bool, str, str]:
    """A process that calls use_allocator(choice) and reports: (jemalloc loaded, its arguments, its stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-c", REPORT, choice, "--flag"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    pid, loaded, args = out.split(" ", 2)
    assert int(pid) == process.pid  # the same process, started again
    return loaded == "True", args.strip(), err


def test_a_real_process_starts_again_with_jemalloc_same_pid_and_arguments():
    loaded, args, _ = started("auto")  # libjemalloc2 comes with `make install` (pyproject.toml's apt list)
    assert loaded and args == "['auto', '--flag']"
    assert started("system")[0] is False


def test_a_preload_that_fails_is_not_retried():
    env = {**os.environ, "LD_PRELOAD": "/gone/libjemalloc.so.2"}
    loaded, _, err = started("auto", env)
    assert not loaded and "LD_PRELOAD names jemalloc" in err
