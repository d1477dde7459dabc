"""The documentation site builds without a warning: every internal link and anchor resolves (issue 31)."""

import os
import subprocess
import sys
from pathlib import Path

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
