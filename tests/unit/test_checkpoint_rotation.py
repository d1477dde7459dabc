"""One durable checkpoint rotation for the trainer and the critic (issue 23, item 3; core/checkpoints.py): staged,
fsynced, renamed, the newest K kept, and never the checkpoint just written deleted."""

from pathlib import Path
from unittest import mock

import pytest

from reinforce.core import checkpoints
from reinforce.core.checkpoints import checkpoint_step, commit_checkpoint, list_checkpoints, start_checkpoint


def write(root: Path, step: int, content: str, keep: int = 2, run_id: str | None = None) -> Path:
    staging = start_checkpoint(root, step)
    (staging / "state.json").write_text(content)
    return commit_checkpoint(staging, keep, run_id)


def test_the_newest_k_are_kept_and_a_redone_step_replaces_its_folder(tmp_path: Path) -> None:
    for step, content in ((1, "a"), (2, "b"), (3, "c"), (3, "c again")):
        write(tmp_path, step, content)
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [2, 3]
    assert (tmp_path / "step-000003" / "state.json").read_text() == "c again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]  # no staging left


def test_the_checkpoint_just_written_is_never_rotated_away(tmp_path: Path) -> None:
    write(tmp_path, 5, "newer")
    written = write(tmp_path, 1, "older step, written last", keep=1)
    assert written.is_dir() and written in list_checkpoints(tmp_path)


def test_a_crash_before_the_rename_leaves_the_old_checkpoints_whole(tmp_path: Path) -> None:
    write(tmp_path, 1, "one")
    write(tmp_path, 2, "two")
    with mock.patch.object(checkpoints, "replace_durably", side_effect=OSError("killed")), pytest.raises(OSError):
        write(tmp_path, 2, "two, redone", keep=1)  # a redone step: the rename that would replace step 2 fails
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001", "step-000002"]  # nothing rotated
    assert (tmp_path / "step-000002" / "state.json").read_text() == "two"
    assert write(tmp_path, 3, "three", keep=1).is_dir()  # the next attempt starts clean


def test_a_manifest_is_written_last_when_a_run_id_is_given(tmp_path: Path) -> None:
    folder = write(tmp_path, 1, "x", run_id="run-a")
    assert checkpoints.read_manifest(folder)["files"].keys() == {"state.json"}
    assert checkpoints.damage(folder) is None
    assert not (write(tmp_path, 2, "y").parent / "step-000002" / checkpoints.MANIFEST).exists()
