"""Checkpoint folders (ROOT/step-NNNNNN), their durable rotation and their manifests.

The trainer (trainer/checkpoint.py, RUN_DIR/checkpoints) and the critic (critic/checkpoint.py,
RUN_DIR/critic_checkpoints) write them alike: into a staging folder (`start_checkpoint`), then `commit_checkpoint`
fsyncs it, renames it into place and keeps the newest K. A crash leaves the old checkpoints and no half-written one;
the rotation runs after the new checkpoint is durable and never deletes it. The supervisor reads the trainer's
manifests before it starts anything, to refuse another run's checkpoints with one line. A manifest (manifest.json,
written last) holds the run's id (RUN_DIR/run_id) and each other file's size and sha256.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reinforce.core.durable import fsync_tree, replace_durably
from reinforce.core.weights import sha256_of

CHECKPOINT_PREFIX = "step-"
MANIFEST = "manifest.json"
# Staging folders and a redone step's old folder start with "." : never a checkpoint to list, resume or rotate.
_STAGING = ".tmp-"
_REPLACED = ".old-"


class ForeignCheckpoint(RuntimeError):
    """A checkpoint written by another run; the message names both run ids."""


def list_checkpoints(root: Path) -> list[Path]:
    """Every complete checkpoint folder, oldest first."""
    return sorted(p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def checkpoint_folder(root: Path, step: int) -> Path:
    return root / f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(folder: Path) -> int:
    return int(folder.name.removeprefix(CHECKPOINT_PREFIX))


def staging_folder(root: Path, step: int) -> Path:
    """Where checkpoint `step` is written before `commit_checkpoint` names it complete."""
    return root / f"{_STAGING}{checkpoint_folder(root, step).name}"


def start_checkpoint(root: Path, step: int) -> Path:
    """An empty staging folder for checkpoint `step` (what a crashed attempt left there is removed)."""
    staging = staging_folder(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(staging: Path, keep: int, run_id: str | None = None) -> Path:
    """Name a filled staging folder a checkpoint, durably, then keep the newest `keep` checkpoints.

    With `run_id` the manifest is written first (it vouches for every other file). Every file is fsynced before the
    rename that promises the checkpoint complete. The same step again (a redone step) moves the old folder aside
    rather than deleting it before the rename. The rotation deletes older checkpoints only, never this one."""
    if run_id is not None:
        write_manifest(staging, run_id)
    fsync_tree(staging)
    final = staging.with_name(staging.name.removeprefix(_STAGING))
    replaced = staging.with_name(_REPLACED + final.name)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        replace_durably(final, replaced)
    replace_durably(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(final.parent)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
