"""Prose is code: every path of this repository named in a comment, docstring, README, docs page, chart or Makefile
exists, and every Makefile target parses and names only what exists; spec and chart field descriptions carry no
measurements and say what a field does on Kubernetes where that differs (issue 23)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel

from generate.chart_values import ChartValues
from reinforce.core.spec import RunSpec, reference_rows
from reinforce.operator.resource import ReinforceRunSpec

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".proto", ".toml", ".txt", ".json", ".tpl", ".cfg"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run"}
# A path that starts at one of the repository's top-level folders.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:services|tests|scripts|charts|examples|benchmarks|proto|operator|docs)/[\w./-]*[\w/])"
)
# Placeholders (examples/EXAMPLE.yaml, RUN_DIR/...) and globs are patterns, not paths.
PATTERN = re.compile(r"[A-Z]{3,}|[*{}<>]")
# Paths in other projects' repositories, cited as such (NVIDIA/TensorRT-LLM's sources in the TensorRT-LLM engine).
ELSEWHERE = {"examples/ray_orchestrator/rl_perf_repro.py", "tests/unittest/llmapi/test_llm_update_weights.py"}


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    paths = [ROOT / name for name in names]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES)]


def named_paths() -> list[tuple[str, str]]:
    """(path named, where: file:line) for every repository path in the tracked text files."""
    found = []
    for file in tracked_text_files():
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), start=1):
            for match in REPO_PATH.finditer(line):
                path = match.group(1).rstrip(".")
                if not PATTERN.search(path) and path not in ELSEWHERE:
                    found.append((path, f"{file.relative_to(ROOT)}:{number}"))
    return found


def exists(path: str) -> bool:
    """From the repository's root, or inside the package (`operator/children.py` in the operator's own text)."""
    return (ROOT / path).exists() or (ROOT / "services" / "reinforce" / path).exists()


def test_every_repository_path_named_in_prose_exists() -> None:
    missing = [f"{where}: {path}" for path, where in named_paths() if not exists(path)]
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_the_scan_sees_paths() -> None:
    """The check above would pass vacuously if the pattern matched nothing."""
    paths = {path for path, _ in named_paths()}
    assert {"tests/e2e/test_cluster_e2e.py", "services/reinforce/core/records_pb2.py"} <= paths


def make_targets() -> list[str]:
    phony = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith(".PHONY:"))
    return phony.split(":", 1)[1].split()


@pytest.mark.parametrize("target", make_targets())
def test_every_make_target_parses(target: str) -> None:
    """`make -n` prints the target's commands without running them: it fails on an unknown target or rule."""
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# A figure with a unit of time, size, rate or ratio, an approximate figure, or words of a measurement or of this
# machine's state: those belong in BENCHMARKS.md and the docs, not in a field's description (CRD, kubectl explain).
MEASUREMENT = re.compile(
    r"~\s*\d|\b\d[\d.]*\s*(?:x\b|%|ms\b|s\b|us\b|µs|[KMG]i?B\b|tok/s|tokens/s|GFLOP|seconds?\b|minutes?\b|hours?\b)"
    r"|\bmeasured\b|\bthis machine\b|\bnot yet run\b|\bbenchmark",
    re.I,
)
# Figures that are rules, not measurements: (field, the figure's text).
RULES = {("restart.reset_after_s", "10 minutes")}  # the kubelet's own back-off reset


DESCRIBED = {"ReinforceRun spec": ReinforceRunSpec, "chart values": ChartValues}  # OperatorConfig: operatorConfig.*


def descriptions(model: type[BaseModel]) -> dict[str, str]:
    """Field path -> description (a section's: its docstring's first line), as the docs' reference tables show them."""
    return {row.path: row.meaning for row in reference_rows(model)}


def measurements(text: str, path: str) -> list[str]:
    return [m.group(0) for m in MEASUREMENT.finditer(text) if (path, m.group(0)) not in RULES]


@pytest.mark.parametrize("model", DESCRIBED.values(), ids=DESCRIBED.keys())
def test_no_field_description_holds_a_measurement(model: type[BaseModel]) -> None:
    found = [f"{path}: {hits}" for path, text in descriptions(model).items() if (hits := measurements(text, path))]
    assert not found, "measurements belong in BENCHMARKS.md or the docs:\n" + "\n".join(found)


def test_the_measurement_scan_sees_measurements() -> None:
    samples = ["66 against 128 ms", "~1e-6", "about 4x float32's peak", "measured faster here", "3.4 GB", "99 tok/s"]
    assert all(measurements(text, "any") for text in samples)
    assert not measurements("kubelet resets its back-off after 10 minutes", "restart.reset_after_s")


# Fields that do something else on Kubernetes than under `reinforce run`.
KUBERNETES_MEANING = [
    "weights.transport",  # always http
    "weights.distribution",  # relay by default
    "restart.max_restarts",  # the operator's crash-loop threshold
    "restart.backoff_s",  # the kubelet's back-off instead
    "restart.max_backoff_s",
    "restart.reset_after_s",  # local only
    "generation.num_generators",  # the generator Deployment's replicas
    "logging.max_component_log_mb",  # the kubelet rotates logs
]


@pytest.mark.parametrize("path", KUBERNETES_MEANING)
def test_fields_that_differ_on_kubernetes_say_so(path: str) -> None:
    description = descriptions(RunSpec)[path]
    assert "Kubernetes" in description, f"{path}: say what it does on Kubernetes"
