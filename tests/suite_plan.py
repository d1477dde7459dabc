"""How `make test` spends its wall time (a pytest plugin, loaded by tests/conftest.py).

- **Scopes.** pytest-xdist hands each worker whole scopes: a scope's tests run one after another in one worker, which
  builds each of their module and session fixtures once. A test's scope is, first found: `MACHINE_WIDE` (one scope
  for everything that shares something machine-wide), `SHARED_FIXTURES` (files whose tests share one expensive
  session fixture), its own id for the files in `PER_TEST` (independent whole runs, spread for balance), else its
  file. Scopes go out longest first by `tests/durations.json` (seconds per scope, written by a whole run with
  `--write-durations`), so no long scope starts last.
- **No core per worker.** Pinning each worker (and what it starts) to a core of its own was measured (issue 42's
  note): no test got faster, and a Triton server started on a busy core crashed in its startup (a boost lock
  exception); the workers share both cores.
- **Shared session results.** `shared_result` builds a session fixture's folder once per run, in whichever worker
  asks first; the other waits for it and reads it (the whole-run baselines).
- **The budget.** A run of more than `$REINFORCE_TEST_BUDGET_S` seconds of wall time (default 2700: 45 minutes,
  half of CI's limit of 90, so that a suite that grows fails here, naming its slowest files, long before a run past
  that limit lands nothing) fails; every run prints its files by time.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
DURATIONS = TESTS / "durations.json"
BUDGET_ENV = "REINFORCE_TEST_BUDGET_S"
DEFAULT_BUDGET_S = 2700.0

# One scope, so one worker, one test at a time: test ids (fnmatch patterns) and what they share with the rest of the
# machine.
MACHINE_WIDE = {
    # dockerd at /var/run/docker.sock, the images scripts/build-images.sh tags there, docker-compose's project names,
    # and the single-node cluster's fixed paths (/var/lib/kubelet, /var/run/dockershim.sock, the kubepods cgroups)
    "tests/e2e/*": "dockerd, its images and the single-node cluster",
    # the escape tests against docker-compose.yml's environment service: its `container` fixture builds the images
    # and runs that service in the machine's dockerd (the same tests against a local process run anywhere)
    "tests/integration/test_environment.py::*container*": "dockerd and its images",
}
# Files whose tests use one fixture that is a set of servers (not a folder shared_result could hand over): one scope
# each, so that they run in a row on one worker and the servers start once (k8s.py's kube_apiserver then stops them).
SHARED_FIXTURES = {
    "tests/integration/test_crd.py": "kube_apiserver",
    "tests/integration/test_operator.py": "kube_apiserver",
    "tests/integration/test_chart.py": "kube_apiserver",
}
# Files of independent whole-pipeline runs with no module fixture worth sharing: each test a scope of its own.
PER_TEST = (
    "tests/integration/test_faults.py",
    "tests/integration/test_pipeline.py",
    "tests/integration/test_recipes.py",
)


def scope_of(nodeid: str) -> str:
    """The xdist scope of a test id (see the module docstring)."""
    if any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in MACHINE_WIDE):
        return "machine-wide"
    file = nodeid.split("::", 1)[0]
    if file in SHARED_FIXTURES:
        return SHARED_FIXTURES[file]
    return nodeid if file.startswith(PER_TEST) else file


def recorded_durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when pytest runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scope scheduling with `scope_of`'s scopes, the longest recorded first. (Not `--dist loadgroup`: xdist
    3.8 renames the grouped tests' ids through an attribute that pytest 9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    durations = recorded_durations()

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            # xdist hands out the queue's first scope (its order: by test count); the longest recorded goes first,
            # the initial ones included (ties, and scopes without a record, keep xdist's order)
            longest = max(self.workqueue, key=lambda scope: durations.get(scope, 0.0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ByScope(config, log)


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this run sees: under xdist the parent of the workers' base folders."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared_result(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s path, built once per run in whichever worker asks first (the other waits on a lock and
    reads it). A build that fails writes no done file, so the next asker builds again (from an empty folder) and
    fails by itself."""
    root = shared_folder(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with _locked(root / f"{name}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            done.write_text(str(build(folder)))
    return Path(done.read_text())


def budget_s() -> float:
    value = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET_S))
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"${BUDGET_ENV} must be a number of seconds, got {value!r}") from None


class Budget:
    """The controller's account (the only process that sees every report): wall time from the start of the
    session, test time (setup, call and teardown) per file; a run past the budget fails, naming the slowest files."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.started = time.monotonic()
        self.by_file: dict[str, float] = defaultdict(float)
        self.by_scope: dict[str, float] = defaultdict(float)
        self.over: str | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.by_file[report.nodeid.split("::", 1)[0]] += report.duration
        self.by_scope[scope_of(report.nodeid)] += report.duration

    def slowest(self, count: int) -> list[tuple[str, float]]:
        return sorted(self.by_file.items(), key=lambda item: -item[1])[:count]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        wall_s = time.monotonic() - self.started
        if wall_s > self.limit_s:
            names = ", ".join(f"{file} ({seconds:.0f} s)" for file, seconds in self.slowest(5))
            self.over = f"the tests took {wall_s:.0f} s of wall time, over the budget of {self.limit_s:g} s "
            self.over += f"(${BUDGET_ENV}); the slowest files: {names}"
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if session.config.getoption("write_durations"):
            by_scope = {scope: round(seconds, 1) for scope, seconds in sorted(self.by_scope.items())}
            DURATIONS.write_text(json.dumps(by_scope, indent=0) + "\n")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        total = sum(self.by_file.values())
        wall_s = time.monotonic() - self.started
        terminalreporter.section(f"test time by file: {total:.0f} s in {wall_s:.0f} s of wall time")
        for file, seconds in self.slowest(len(self.by_file)):
            terminalreporter.write_line(f"{seconds:8.1f} s  {file}")
        if self.over:
            terminalreporter.write_line(f"FAILED: {self.over}", red=True, bold=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    where = DURATIONS.relative_to(TESTS.parent)
    parser.addoption("--write-durations", action="store_true", help=f"write each scope's test time to {where}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(Budget(budget_s()), "reinforce-test-budget")
