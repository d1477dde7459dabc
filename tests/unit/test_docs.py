"""The documentation site builds without a warning (every internal link and anchor resolves), and the README stays
a short page whose links all resolve (issue 31)."""

import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict_has_no_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no end-of-life banner in the output
    )
    warnings = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, done.stderr
    pages = list((tmp_path / "site").rglob("index.html"))
    assert len(pages) >= 20, f"only {len(pages)} pages built"


README_LINES = 150  # a newcomer reads it in five minutes; the rest is the site


def test_the_readme_is_short_and_links_only_to_what_exists() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith("http")]
    assert "docs/assets/architecture.svg" in targets and "docs/reference/spec.md" in targets
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_readme_starts_with_the_two_commands_ci_and_users_run() -> None:
    """.ci/run runs `make test`; a newcomer runs `make quickstart`: both are the README's first code block."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make quickstart", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_architecture_picture_is_an_svg_naming_every_service() -> None:
    svg = ElementTree.parse(ROOT / "docs" / "assets" / "architecture.svg").getroot()
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"trainer", "generator × N", "reward server", "weight reconciler", "environment service"} <= texts
