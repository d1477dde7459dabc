"""tests/suite_plan.py, the plan of `make test`: scopes, shared session results and the time budget that fails a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_plan import BUDGET_ENV, PER_TEST, SHARED_FIXTURES, scope_of, shared_result

TESTS = Path(__file__).resolve().parents[1]


def test_scopes_keep_files_together_and_spread_independent_whole_runs() -> None:
    spec_file = scope_of("tests/unit/test_spec.py::test_a[1]")
    assert spec_file == scope_of("tests/unit/test_spec.py::test_b") != scope_of("tests/unit/test_ppo.py::test_a")
    assert {scope_of(f"{file}::test_x") for file in SHARED_FIXTURES} == {"kube_apiserver"}
    assert scope_of(f"{PER_TEST[0]}::test_a") != scope_of(f"{PER_TEST[0]}::test_b")
    machine_wide = ["tests/e2e/test_compose.py::test_a", "tests/integration/test_environment.py::test_b[container]"]
    assert {scope_of(nodeid) for nodeid in machine_wide} == {"machine-wide"}
    assert scope_of("tests/integration/test_environment.py::test_b[process]") == "tests/integration/test_environment.py"


def test_a_shared_result_is_built_once_and_a_failed_build_leaves_nothing(tmp_path_factory) -> None:
    builds: list[Path] = []

    def build(folder: Path) -> Path:
        builds.append(folder)
        (folder / "out").write_text("built")
        return folder / "out"

    def failing(folder: Path) -> Path:
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        shared_result(tmp_path_factory, "plan-test", failing)
    first = shared_result(tmp_path_factory, "plan-test", build)
    assert shared_result(tmp_path_factory, "plan-test", build) == first and first.read_text() == "built"
    assert len(builds) == 1


def run_suite(folder: Path, budget_s: str) -> subprocess.CompletedProcess[str]:
    """pytest with the plan as its plugin, on a file of one test that sleeps a second."""
    (folder / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(1)\n")
    env = {**os.environ, BUDGET_ENV: budget_s, "PYTHONPATH": str(TESTS)}
    argv = [sys.executable, "-m", "pytest", "-p", "suite_plan", "-p", "no:cacheprovider", "test_sleeps.py"]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_past_its_budget_fails_naming_the_slowest_files(tmp_path: Path) -> None:
    within = run_suite(tmp_path, "600")
    assert within.returncode == 0, within.stdout[-2000:]
    assert "test time by file:" in within.stdout and "test_sleeps.py" in within.stdout
    over = run_suite(tmp_path, "0.5")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "1 passed" in over.stdout  # every test passed: the budget alone failed the run
    assert f"over the budget of 0.5 s (${BUDGET_ENV}); the slowest files: test_sleeps.py (1 s)" in over.stdout
    bad = run_suite(tmp_path, "soon")
    assert bad.returncode == 4 and f"${BUDGET_ENV} must be a number of seconds, got 'soon'" in bad.stderr
