"""Checkpoint folders of a run (RUN_DIR/checkpoints/step-NNNNNN) and their manifests.

The trainer writes them (trainer/checkpoint.py); the supervisor reads their manifests before it starts anything, to
refuse another run's checkpoints with one line. A manifest (manifest.json, written last) holds the run's id
(RUN_DIR/run_id) and each other file's size and sha256.
"""

from __future__ import annotations

import json
from pathlib import Path

from reinforce.core.weights import sha256_of

CHECKPOINT_PREFIX = "step-"
MANIFEST = "manifest.json"


class ForeignCheckpoint(RuntimeError):
    """A checkpoint written by another run; the message names both run ids."""


def list_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def write_manifest(folder: Path, run_id: str) -> None:
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    (folder / MANIFEST).write_text(json.dumps({"run_id": run_id, "files": files}, indent=1))


def read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("run_id"), str)):
        return None
    files = manifest.get("files")
    return manifest if isinstance(files, dict) and all(isinstance(f, dict) for f in files.values()) else None


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, naming the file (None: every file matches its manifest)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"{folder / MANIFEST} is missing or unreadable"
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{path} holds {size} bytes, its manifest says {expected.get('bytes')}"
        if sha256_of(path) != expected.get("sha256"):
            return f"{path} does not match its sha256 in the manifest"
    return None


def refuse_foreign_checkpoints(root: Path, run_id: str) -> None:
    """Raise ForeignCheckpoint if a checkpoint's manifest names another run (reads the manifests only)."""
    for folder in list_checkpoints(root):
        manifest = read_manifest(folder)
        if manifest is not None and manifest["run_id"] != run_id:
            raise ForeignCheckpoint(
                f"checkpoint {folder} belongs to run {manifest['run_id']}, not to this run ({run_id}): "
                "move it away, or resume the run it belongs to"
            )
