"""The run outlives its displays (issue 30, R3-1): rows with nulls, and lines that are not rows, never raise."""

from __future__ import annotations

import json
import math
from pathlib import Path

from reinforce.core.metrics import read_metrics, shown
from reinforce.core.run_dir import RunPaths
from reinforce.supervisor.progress import Progress, print_summary


def write_rows(paths: RunPaths, *rows: dict, tail: str = "") -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


# A step whose every reward failed: the trainer writes NaN and inf as null.
NULL_ROW = {
    "step": 2,
    "train_rollouts/rewards": None,
    "train_rollouts/init_policy_kl": None,
    "throughput/generated_tokens_per_second": 12.0,
}
GOOD_ROW = {
    "step": 1,
    "train_rollouts/rewards": 0.5,
    "train_rollouts/init_policy_kl": 0.01,
    "throughput/generated_tokens_per_second": 10.0,
}


def test_the_progress_bar_and_summary_take_null_metrics(tmp_path: Path, capsys) -> None:
    paths = RunPaths(tmp_path / "run")
    write_rows(paths, GOOD_ROW, NULL_ROW)
    progress = Progress(paths, total_steps=4)
    progress.update()
    assert progress.bar.n == 2
    assert progress.bar.postfix is not None and "reward=-" in progress.bar.postfix
    progress.close()
    print_summary(paths)
    assert "reward 0.500 -> -" in capsys.readouterr().out


def test_a_skipped_step_row_without_the_algorithms_metrics_is_shown(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    write_rows(paths, {"step": 1, "train_rollouts/rewards": None, "train_optim/skipped_empty_steps": 1.0})
    progress = Progress(paths, total_steps=4)
    progress.update()
    assert progress.bar.n == 1
    progress.close()


def test_lines_that_are_not_rows_are_skipped(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    write_rows(paths, GOOD_ROW, tail='{"step": 2, "train_rol\n\x00\x00\n[1, 2]\n{"no_step": 1}\n')
    assert read_metrics(paths.metrics) == [GOOD_ROW]


def test_shown_formats_or_dashes() -> None:
    assert shown(0.12345, ".3f") == "0.123"
    assert [shown(v, ".3f") for v in (None, math.nan, math.inf)] == ["-", "-", "-"]
