"""`reinforce status`'s phase of a run folder no supervisor holds (supervisor/status.py), from its files alone."""

from __future__ import annotations

import json
from pathlib import Path

from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import dump_spec, load_spec
from reinforce.supervisor.outcome import record_outcome
from reinforce.supervisor.status import status_lines

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


def _folder(tmp_path: Path, steps_done: int) -> RunPaths:
    paths = RunPaths(tmp_path)
    paths.spec.write_text(dump_spec(load_spec(TINY)))
    rows = [{"step": s, "time": 0.0, "train_rollouts/rewards": 0.5} for s in range(1, steps_done + 1)]
    paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def test_a_folder_without_steps_has_not_started(tmp_path):
    assert status_lines(_folder(tmp_path, 0))[0] == "run tiny: not started"


def test_a_failure_is_named_by_the_first_line_of_the_error(tmp_path):
    paths = _folder(tmp_path, 0)  # a trainer that never finished a step still failed
    record_outcome(paths, 1, "component trainer exited with code 1; giving up. Log X/trainer.log, last lines:\nboom")
    assert status_lines(paths)[0] == (
        "run tiny: failed (component trainer exited with code 1; giving up. Log X/trainer.log; "
        f"`reinforce run --resume {tmp_path}` continues it)"
    )


def test_a_supervisor_that_ended_without_a_word_was_killed(tmp_path):
    paths = _folder(tmp_path, 3)
    assert status_lines(paths)[0].startswith("run tiny: failed (the supervisor ended without recording why (killed?)")
    assert "  step        3 / 30" in status_lines(paths)
