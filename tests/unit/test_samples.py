"""The samples table's parts (core/samples.py): which samples a step keeps, the file, a resume's cleanup."""

from __future__ import annotations

import json
import math
import os

import pytest

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import (
    discard_samples_after,
    format_sample,
    pick_samples,
    read_samples,
    sample_steps,
    write_samples,
)
from reinforce.core.spec import SpecError


def test_the_best_and_the_worst_come_first_then_the_first_others_in_order():
    rewards = [0.5, 0.9, 0.1, 0.9, 0.3]
    assert pick_samples(rewards, 4) == [(1, "best"), (2, "worst"), (0, "first"), (3, "first")]
    assert pick_samples(rewards, 1) == [(1, "best")]
    assert pick_samples(rewards, 10) == [(1, "best"), (2, "worst"), (0, "first"), (3, "first"), (4, "first")]


def test_a_non_finite_reward_is_neither_best_nor_worst_and_equal_rewards_give_one_pick():
    assert pick_samples([math.nan, 0.2, math.inf, 0.4], 3) == [(3, "best"), (1, "worst"), (0, "first")]
    assert pick_samples([0.5, 0.5, 0.5], 2) == [(0, "best"), (1, "first")]
    assert pick_samples([math.nan, math.nan], 2) == [(0, "first"), (1, "first")]


def _row(step: int, **values) -> dict:
    row = {"step": step, "pick": "best", "prompt_id": f"{step - 1}-0", "prompt": "say a", "response": "aa\nb"}
    return {**row, "reward": 1.0, "advantage": 0.5, "kl": 0.01, "response_tokens": 4, "is_end": True, **values}


def test_files_are_json_lines_with_nan_as_null(tmp_path):
    paths = RunPaths(tmp_path)
    write_samples(paths, 3, [_row(3, reward=math.nan, advantage=None, kl=None)])
    text = paths.samples_file(3).read_text()
    assert paths.samples_file(3).name == "step-000003.jsonl" and "NaN" not in text
    assert json.loads(text)["reward"] is None
    assert read_samples(paths, 3)[0]["response"] == "aa\nb"


def test_a_resume_discards_the_samples_of_the_steps_it_redoes(tmp_path):
    paths = RunPaths(tmp_path)
    for step in (1, 2, 3, 4):
        write_samples(paths, step, [_row(step)])
    discard_samples_after(paths, 2)
    assert sample_steps(paths) == [1, 2]


def test_a_sample_for_people_shows_its_numbers_and_quoted_texts_cut_to_length():
    shown = format_sample(_row(7, response="a" * 50, is_end=False), max_chars=10)
    assert shown.splitlines() == [
        "step 7 best: reward 1.0000  advantage +0.5000  KL 0.0100  4 tokens (cut at max_new_tokens)",
        '  prompt:   "say a"',
        '  response: "aaaaaaaaaa" ... (50 characters)',
    ]
    assert "advantage -  KL -" in format_sample(_row(1, advantage=None, kl=None))


def test_malformed_samples_files_are_named_with_their_line(tmp_path):
    """The red team's R4-13: a stray file name, a truncated line or a row of another shape is no traceback, and a
    FIFO in a file's place is no hang (read_samples opened it for reading, which waits for a writer forever)."""
    paths = RunPaths(tmp_path)
    write_samples(paths, 1, [_row(1)])
    (paths.samples / "step-abc.jsonl").write_text("{}\n")  # not the trainer's name: not a step
    assert sample_steps(paths) == [1]
    paths.samples_file(2).write_text(json.dumps(_row(2)) + '\n{"step": 2, "pick"')
    with pytest.raises(SpecError, match=rf"{paths.samples_file(2)}:2: not a JSON line"):
        read_samples(paths, 2)
    paths.samples_file(3).write_text('{"step": 3}\n')
    with pytest.raises(SpecError, match=rf"{paths.samples_file(3)}:1: not a sample row \(missing pick, "):
        read_samples(paths, 3)
    os.mkfifo(paths.samples_file(4))
    with pytest.raises(SpecError, match="not a regular file"):
        read_samples(paths, 4)


def test_a_fifo_in_place_of_metrics_reads_as_no_rows(tmp_path, caplog):
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    assert "is not a regular file" in caplog.text
