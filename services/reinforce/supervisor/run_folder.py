"""The run folder `reinforce run` writes into: locked for one supervisor, emptied for --overwrite, refused when it
holds another run (or another run's checkpoints), cleared of what a crash left half-written."""

from __future__ import annotations

import shutil
from pathlib import Path

from reinforce.core.checkpoints import ForeignCheckpoint, refuse_foreign_checkpoints
from reinforce.core.run_dir import RunPaths, ensure_run_id
from reinforce.core.spec import RunSpec
from reinforce.supervisor.component import RunFailed
from reinforce.supervisor.lock import RunFolderBusy, RunLock


def prepare_run_dir(spec: RunSpec, resume: bool, overwrite: bool) -> tuple[RunPaths, RunLock]:
    """The run folder, locked for this supervisor before anything in it is read, deleted or written."""
    paths = RunPaths(spec.resolved_run_dir())
    try:
        lock = RunLock(paths.lock)
    except RunFolderBusy as err:
        raise RunFailed(str(err)) from None
    started = paths.metrics.exists() or paths.checkpoints.exists()
    if started and overwrite:
        _empty_folder(paths.root, keep=paths.lock)
    elif started and not resume:
        lock.release()
        raise RunFailed(
            f"run folder {paths.root} already holds a run: pass --resume to continue it or --overwrite to start over"
        )
    if not resume:
        shutil.rmtree(paths.redis, ignore_errors=True)  # a fresh run starts from an empty queue
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.remove_partial_files()  # what an earlier life's crash or full disk left half-written
    try:
        refuse_foreign_checkpoints(paths.checkpoints, ensure_run_id(paths))
    except ForeignCheckpoint as err:
        lock.release()
        raise RunFailed(str(err)) from None
    return paths, lock


def _empty_folder(folder: Path, keep: Path) -> None:
    """Delete what `folder` holds except `keep` (the held lock: deleting it would let another supervisor in)."""
    for entry in folder.iterdir():
        if entry == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
