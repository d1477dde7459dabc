"""The layout's rules: a service imports `reinforce.core` and itself, never another service; core imports none; and
core holds only what two or more services or other core modules use (issue 23, item 1)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "services" / "reinforce"
SERVICES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "core")


def imported_modules(source: Path, with_names: bool = False) -> set[str]:
    """Modules a file imports; with_names, also `package.name` for each name of a `from package import name`."""
    tree = ast.parse(source.read_text(), filename=str(source))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if with_names:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
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


@functools.cache
def core_users() -> dict[str, set[str]]:
    """core module -> its users: the services that import it, and the other core modules that do ("core.NAME"): a
    contract the weight reconciler (core/rollout.py) speaks is used by the supervisor and the operator, which run it.
    `from reinforce.core import x` counts as a use of x."""
    users: dict[str, set[str]] = {}
    sources = [(service, source) for service in SERVICES for source in (PACKAGE / service).rglob("*.py")]
    sources += [(f"core.{source.stem}", source) for source in (PACKAGE / "core").glob("*.py")]
    for user, source in sources:
        for module in imported_modules(source, with_names=True):
            parts = module.split(".")
            if parts[:2] == ["reinforce", "core"] and len(parts) > 2 and user != f"core.{parts[2]}":
                users.setdefault(parts[2], set()).add(user)
    return users


CORE_MODULES = sorted(p.stem for p in (PACKAGE / "core").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", CORE_MODULES)
def test_every_core_module_has_two_users(module):
    """core holds what crosses a process boundary: a module one service alone uses belongs in that service."""
    users = core_users().get(module, set())
    assert len(users) >= 2, f"core/{module}.py is used by {sorted(users) or 'nothing'}: move it there"


PROSE_KEYWORDS = {"description", "help"}  # a field's or a flag's text may name an address


def address_literals(source: Path) -> list[int]:
    """The lines of every string constant in code that holds 127.0.0.1 or 0.0.0.0 (docstrings, field descriptions and
    flag help aside)."""
    tree = ast.parse(source.read_text(), filename=str(source))
    prose = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    prose |= {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg in PROSE_KEYWORDS}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        if "127.0.0.1" in node.value or "0.0.0.0" in node.value
    ]


def test_addresses_come_from_names():
    """The loopback and any-address hosts are names.LOCAL_HOST and names.ANY_HOST, never literals beside them."""
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "core" / "names.py"]
    hits = [f"{source.relative_to(PACKAGE)}:{line}" for source in sources for line in address_literals(source)]
    assert hits == []


def test_the_address_scan_sees_literals(tmp_path: Path):
    source = tmp_path / "example.py"
    source.write_text(
        '"""Listens on 127.0.0.1."""\n'
        'URL = f"http://127.0.0.1:{1}"\n'
        'parser.add_argument("--host", default="0.0.0.0", help="default 0.0.0.0")\n'
    )
    assert address_literals(source) == [2, 3]


def test_no_two_test_files_share_a_name():
    """pytest imports test modules by their file name (the test folders are not packages), so a second
    tests/*/test_x.py is a collection error that stops the whole run, as CI once found."""
    tests = Path(__file__).resolve().parents[1]
    names: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
