"""The layout's one rule: a service imports `reinforce.core` and itself, never another service; core imports none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "services" / "reinforce"
SERVICES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "core")


def imported_modules(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(), filename=str(source))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def foreign_imports(folder: str, allowed: set[str]) -> list[str]:
    """'file: module' for every reinforce.<folder> import of a folder outside `allowed`."""
    bad = []
    for source in sorted((PACKAGE / folder).rglob("*.py")):
        for module in imported_modules(source):
            parts = module.split(".")
            if parts[0] == "reinforce" and len(parts) > 1 and parts[1] not in allowed:
                bad.append(f"{source.relative_to(PACKAGE)}: {module}")
    return bad


def test_the_services_are_found():
    assert {"critic", "generator", "operator", "reward", "supervisor", "trainer"} <= set(SERVICES)


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_only_core_and_itself(service):
    assert foreign_imports(service, {"core", service}) == []


def test_core_imports_no_service():
    assert foreign_imports("core", {"core"}) == []
