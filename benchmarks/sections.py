"""BENCHMARKS.md is written by several scripts, each owning one `## ` section: one writer for all of them."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

MARKDOWN = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
PREAMBLE = (
    "# Benchmarks\n\nEach section is written by the script it names, from that script's saved results "
    "(benchmarks/results/); do not edit by hand.\n"
)


def replace_section(markdown: str, section: str) -> str:
    """`markdown` with the section under the section's heading (its first line, up to the next second-level
    heading) replaced or appended."""
    heading = section.splitlines()[0]
    start = markdown.find(heading)
    if start < 0:
        return markdown.rstrip("\n") + "\n\n" + section
    end = markdown.find("\n## ", start + len(heading))
    return markdown[:start] + section + (markdown[end:] if end >= 0 else "")


def machine(load_average: float) -> dict:
    """What a section says of the machine: CPUs, Python, and the 1-minute load average when the measuring began."""
    return {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(), "load_average": load_average}


def add_render_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--render", action="store_true", help="only rewrite BENCHMARKS.md from the saved JSON")


def render_saved(results_file: Path, render: Callable[[dict], str]) -> None:
    write_section(render(json.loads(results_file.read_text())))


def save_and_write(results_file: Path, results: dict, render: Callable[[dict], str]) -> None:
    """Save a script's results (benchmarks/results/), write its section of BENCHMARKS.md from them, print it."""
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(results, indent=2) + "\n")
    section = render(results)
    write_section(section)
    print(section)


def write_section(section: str) -> None:
    """Replace (or append) `section` in BENCHMARKS.md, keeping every other script's sections; the text before the
    first section is PREAMBLE."""
    markdown = MARKDOWN.read_text() if MARKDOWN.exists() else PREAMBLE
    first = markdown.find("\n## ")
    markdown = PREAMBLE + ("\n" + markdown[first + 1 :] if first >= 0 else "")
    MARKDOWN.write_text(replace_section(markdown, section))
