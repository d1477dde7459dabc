"""BENCHMARKS.md is written by several scripts, each owning one `## ` section: one writer for all of them."""

from __future__ import annotations

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


def write_section(section: str) -> None:
    """Replace (or append) `section` in BENCHMARKS.md, keeping every other script's sections; the text before the
    first section is PREAMBLE."""
    markdown = MARKDOWN.read_text() if MARKDOWN.exists() else PREAMBLE
    first = markdown.find("\n## ")
    markdown = PREAMBLE + ("\n" + markdown[first + 1 :] if first >= 0 else "")
    MARKDOWN.write_text(replace_section(markdown, section))
