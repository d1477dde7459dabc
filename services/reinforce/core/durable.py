"""Writing files so that a crash (power loss, kernel panic, a killed node) leaves the old version or the new one.

A rename is atomic but not durable by itself: without fsync the new name can reach the disk before the data it
names, and a crash then leaves an empty or partial file under the final name. So: write elsewhere, fsync the data,
rename, fsync the folder that holds the name.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync one file, or a folder (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, and `folder` itself."""
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(parent) / name)
        fsync_path(Path(parent))


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` (a file or folder, already fsynced) over `target`, and make the rename itself durable."""
    os.replace(source, target)
    fsync_path(target.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: readers see the old content or the new, never a mix, even after a crash."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a partial copy beside the file
        raise
