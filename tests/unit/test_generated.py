"""Generated files stay in step with their single source of truth (`make generate` and `make proto` rewrite them)."""

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from generate import chart_values, crd, dashboards, docs, operator_manifest, readme
from reinforce.core.spec import reference_rows

ROOT = Path(__file__).resolve().parents[2]


def test_records_pb2_matches_the_proto(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto/reinforce/v1'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", "records.proto"],
        check=True,
    )  # fmt: skip
    for name in ("records_pb2.py", "records_pb2.pyi"):
        committed = (ROOT / "services/reinforce/core" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"services/reinforce/core/{name} is stale: run `make proto`"


@pytest.mark.parametrize(
    "module", [crd, chart_values, operator_manifest, dashboards, readme, docs], ids=lambda m: m.__name__
)
def test_committed_files_match_their_source(module):
    for path, content in module.generated_files().items():
        assert path.exists() and path.read_text() == content, f"{path.relative_to(ROOT)} is stale: run `make generate`"


def test_no_stray_dashboard():
    written = {p for p in dashboards.generated_files() if p.suffix == ".json"}
    assert set(dashboards.DASHBOARDS_DIR.glob("*.json")) == written


def test_the_installed_package_writes_nothing_into_the_source_tree():
    """Generators live in scripts/generate, outside the package: no module of it names a repository file to write."""
    package = ROOT / "services" / "reinforce"
    offenders = [p for p in package.rglob("*.py") if "write_text(" in p.read_text() and "parents[" in p.read_text()]
    assert not offenders, offenders


def _key_paths(value: Any, path: str = "") -> list[str]:
    """Dotted path of every mapping key in a loaded YAML document."""
    if not isinstance(value, dict):
        return []
    paths = []
    for key, child in value.items():
        here = f"{path}.{key}" if path else str(key)
        paths += [here, *_key_paths(child, here)]
    return paths


def test_values_yaml_documents_every_key():
    """Each key of values.yaml has a `## @param` line (`<name>` stands for a map's keys; a map-valued key such as
    `resources` covers the data under it), and each `## @param` names a key of the values model."""
    text = (chart_values.CHART / "values.yaml").read_text()
    documented = re.findall(r"^## @param (\S+)", text, re.M)
    patterns = [re.escape(p).replace(re.escape("<name>"), r"[^.]+").replace(re.escape("[]"), "") for p in documented]
    leaves = [p for p in patterns if not any(q.startswith(p + r"\.") for q in patterns)]
    missing = [
        path
        for path in _key_paths(yaml.safe_load(text))
        if not any(re.fullmatch(p, path) or re.match(p + r"\.", path) for p in (*patterns, *leaves))
    ]
    assert not missing, f"values.yaml keys without a `## @param` line: {missing}"
    model = {row.path for row in reference_rows(chart_values.ChartValues, by_alias=True)}
    assert set(documented) <= model
