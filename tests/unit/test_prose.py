"""Prose is code: every path of this repository named in a comment, docstring, README, docs page, chart or Makefile
exists, and every Makefile target parses and names only what exists; spec and chart field descriptions carry no
measurements and say what a field does on Kubernetes where that differs (issue 23)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from generate.chart_values import ChartValues
from reinforce.core.spec import RunSpec, reference_rows
from reinforce.operator.resource import KubernetesSpec, PodSpec, ReinforceRunSpec

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "reinforce"
SNAKE_CASE_CRD = ROOT / "tests" / "integration" / "crd-snake-case.yaml"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".proto", ".toml", ".txt", ".json", ".tpl", ".cfg"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run"}
# A path that starts at one of the repository's top-level folders.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:services|tests|scripts|charts|examples|benchmarks|proto|operator|docs)/[\w./-]*[\w/])"
)
# A path inside the package, as its own prose writes them: `core/spec.py`, `trainer/algorithms/`.
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(SUBPACKAGES)})/[\w./-]*[\w/])")
# A markdown file named alone: BENCHMARKS.md, getting-started.md.
MARKDOWN_NAME = re.compile(r"(?<![\w./-])([\w-]+\.md)(?![\w-])")
# Placeholders (examples/EXAMPLE.yaml, RUN_DIR/...) and globs are patterns, not paths.
PATTERN = re.compile(r"[A-Z]{3,}(?!.*\.md$)|[*{}<>]")
# Paths in other projects' repositories, cited as such (NVIDIA/TensorRT-LLM's sources in the TensorRT-LLM engine), and
# what only looks like a package path: Kubernetes' core/v1 API, a rate in reward per second.
ELSEWHERE = {
    "examples/ray_orchestrator/rl_perf_repro.py", "tests/unittest/llmapi/test_llm_update_weights.py",
    "core/v1", "reward/s",
}  # fmt: skip


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    paths = [ROOT / name for name in names]
    return [p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES)]


def named(pattern: re.Pattern[str]) -> list[tuple[str, Path, int]]:
    """(path named, the file naming it, its line) for every match of `pattern` in the tracked text files but this one,
    whose checks name slips on purpose, and an earlier release's CRD, kept as it was released."""
    found = []
    for file in [f for f in tracked_text_files() if f not in (Path(__file__), SNAKE_CASE_CRD)]:
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), start=1):
            for match in pattern.finditer(line):
                path = match.group(1).rstrip(".")
                if not PATTERN.search(path) and path not in ELSEWHERE:
                    found.append((path, file, number))
    return found


def named_paths() -> list[tuple[str, str]]:
    """(path named, where: file:line) for every repository path in the tracked text files."""
    return [(path, f"{file.relative_to(ROOT)}:{number}") for path, file, number in named(REPO_PATH)]


def exists(path: str) -> bool:
    """From the repository's root, or inside the package (`operator/children.py` in the operator's own text)."""
    return (ROOT / path).exists() or (PACKAGE / path).exists()


def test_every_repository_path_named_in_prose_exists() -> None:
    missing = [f"{where}: {path}" for path, where in named_paths() if not exists(path)]
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_the_scan_sees_paths() -> None:
    """The check above would pass vacuously if the pattern matched nothing."""
    paths = {path for path, _ in named_paths()}
    assert {"tests/e2e/test_cluster_e2e.py", "services/reinforce/core/records_pb2.py"} <= paths


def test_every_package_path_named_in_prose_exists() -> None:
    """`core/engine_choice.py` is services/reinforce/core/engine_choice.py (or a path from the root: `operator/`)."""
    missing = [f"{file.relative_to(ROOT)}:{n}: {path}" for path, file, n in named(PACKAGE_PATH) if not exists(path)]
    assert not missing, "package paths named but not in services/reinforce/:\n" + "\n".join(missing)


def markdown_exists(name: str) -> bool:
    """A markdown file named alone: one at the repository's root, or a docs page (`security.md`: a relative link)."""
    return (ROOT / name).exists() or any((ROOT / "docs").rglob(name))


def test_every_markdown_file_named_in_prose_exists() -> None:
    missing = [
        f"{file.relative_to(ROOT)}:{n}: {name}" for name, file, n in named(MARKDOWN_NAME) if not markdown_exists(name)
    ]
    assert not missing, "markdown files named but not in the repository:\n" + "\n".join(missing)


def test_the_scans_see_package_paths_and_markdown_names() -> None:
    """The two checks above would pass vacuously if their patterns matched nothing; and they catch a slip."""
    assert {"core/spec.py", "supervisor/engine_choice.py"} <= {path for path, _, _ in named(PACKAGE_PATH)}
    assert {"BENCHMARKS.md", "README.md"} <= {name for name, _, _ in named(MARKDOWN_NAME)}
    assert PACKAGE_PATH.search("auto is torch (core/engine_choice.py)").group(1) == "core/engine_choice.py"
    assert not exists("core/engine_choice.py")
    assert not markdown_exists("DESIGN.md")
    assert not MARKDOWN_NAME.search("document.querySelector('input.md-search__input')")


def test_the_security_page_states_the_crds_components_and_size() -> None:
    """Why the CRD does not embed the PodTemplateSpec schema: per component, against the CRD's own size as JSON (what
    `kubectl apply`'s annotation holds); both drift as the spec grows."""
    text = (ROOT / "docs" / "kubernetes" / "security.md").read_text()
    components = [name for name, field in KubernetesSpec.model_fields.items() if field.annotation is PodSpec]
    listed = re.search(r"Each component \(([^)]*)\) takes", text).group(1)
    assert re.findall(r"`(?:kubernetes\.)?(\w+)`", listed) == components
    count = re.search(r"\((\w+) components: ", text).group(1)
    assert count == ["one", "two", "three", "four", "five", "six", "seven", "eight"][len(components) - 1]
    crd = yaml.safe_load((ROOT / "charts" / "reinforce" / "crds" / "reinforceruns.yaml").read_text())
    kilobytes = len(json.dumps(crd, separators=(",", ":"))) / 1000
    stated = int(re.search(r"this CRD's (\d+) KB as JSON", text).group(1))
    assert abs(stated - kilobytes) < 0.1 * kilobytes, f"the CRD is {kilobytes:.0f} KB as JSON, the page says {stated}"


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
