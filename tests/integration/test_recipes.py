"""The tiny example learns under the recipes of the peers' algorithms (tests/runs.py RECIPES), through real processes;
DAPO's dynamic sampling keeps the exactly-once audit."""

import json

import pytest
from runs import RECIPES, assert_reward_rose, reinforce, write_spec

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dr_grpo", "dapo", "gspo"])
def test_tiny_run_learns_under_each_recipe(tmp_path, recipe):
    result = reinforce("run", str(write_spec(tmp_path, algorithm=RECIPES[recipe])))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert_reward_rose(rows)
    if recipe != "dapo":
        return
    # every prompt id a step enqueued was trained or filtered, once: 8 trained, the filtered ones replaced in order
    audit = [json.loads(line) for line in paths.trained_groups.read_text().splitlines()]
    for row, metrics in zip(audit, rows, strict=True):
        trained, filtered = row["prompt_ids"], row["filtered_prompt_ids"]
        step = row["step"] - 1
        assert sorted(trained + filtered) == sorted(f"{step}-{i}" for i in range(8 + len(filtered)))
        assert metrics["train_rollouts/filtered_groups"] == len(filtered)
    assert sum(len(row["filtered_prompt_ids"]) for row in audit) > 0  # the random policy's all-zero groups
