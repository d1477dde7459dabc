"""Validation and experiment trackers through real processes: `reinforce run` on the tiny example.

Validation prompts go through the same generators and reward server; their metrics appear in metrics.jsonl at
the start, every val_every steps and at the end, and never in the audit trail. TensorBoard's event files,
W&B's offline run file and MLflow's local file store are read back and hold what metrics.jsonl holds.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from runs import (
    EXAMPLES,
    MEGATRON_TP2,
    assert_each_step_trained_once,
    reinforce,
    service_pids,
    start,
    wait_for_step,
    write_spec,
)

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import read_samples, sample_steps
from reinforce.core.trackers import wandb_history, wandb_history_steps

VAL = ("val/rewards", "val/response_lengths", "val/init_policy_kl")


def _spec(tmp_path: Path, trackers: list[str], **training) -> Path:
    return write_spec(
        tmp_path,
        data={"validation_prompts": str(EXAMPLES / "data" / "tiny.txt")},
        training={"steps": 5, "val_every": 2, "checkpoint_every": 2, **training},
        validation={"num_prompts": 6, "temperature": 0.0, "num_logged_responses": 3},
        logging={"trackers": trackers},
    )


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of _spec with validation and the three trackers, to its end (this module's tests share it: its
    file's tests run on one worker)."""
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module)
    folder = tmp_path_factory.mktemp("tracked")
    result = reinforce("run", str(_spec(folder, ["tensorboard", "wandb", "mlflow"])))
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run"


@pytest.mark.slow
def test_validation_and_trackers_in_a_real_run(tracked_run):
    run_dir = tracked_run
    paths = RunPaths(run_dir)
    rows = read_metrics(paths.metrics)

    # validation at the start (a row of its own), every 2 steps and at the end
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "val/rewards" in r] == [0, 2, 4, 5]
    assert set(rows[0]) == {"step", "time", *VAL, "val/fraction_of_samples_properly_ended", "timers/validation"}
    for r in rows:
        if "val/rewards" in r:
            assert 0.0 <= r["val/rewards"] <= 1.0 and r["val/response_lengths"] > 0
            assert r["val/init_policy_kl"] >= 0.0
    assert rows[0]["val/init_policy_kl"] < 1e-5  # version 0 is the reference
    assert rows[-1]["val/init_policy_kl"] > 0.0
    # validation groups never trained on: the audit holds exactly the training prompts
    assert_each_step_trained_once(run_dir, 5)
    for step in (0, 2, 4, 5):
        table = [json.loads(line) for line in (paths.validation / f"step-{step:06d}.jsonl").read_text().splitlines()]
        assert len(table) == 3 and all(t["prompt_id"].startswith(f"val-{step}-") for t in table)
        assert {"prompt", "response", "reward"} <= set(table[0])

    assert_trackers_hold_the_metrics(run_dir, rows)


@pytest.mark.slow
def test_killed_trainer_continues_its_tracker_runs_without_duplicate_steps(tmp_path):
    """kill -9 the trainer after step 3 (last checkpoint: step 2): the restarted trainer redoes step 3 into the
    same tracker runs, and each tracker holds every step once, with the values of metrics.jsonl."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    proc = start("run", str(_spec(tmp_path, ["tensorboard", "wandb", "mlflow"])))
    run_dir = tmp_path / "run"
    wait_for_step(proc, run_dir, 3)
    os.kill(service_pids(run_dir, "reinforce.trainer")[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "component trainer exited with code -9" in stderr
    rows = read_metrics(RunPaths(run_dir).metrics)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "val/rewards" in r] == [0, 2, 4, 5]
    assert_each_step_trained_once(run_dir, 5)
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # two lives, one W&B run id
    assert_trackers_hold_the_metrics(run_dir, rows)
    assert_trackers_hold_the_samples_once(run_dir, steps=5)


@pytest.mark.slow
def test_validation_with_tensor_parallelism_matches_the_torch_backend(tmp_path, tracked_run):
    """backend megatron, tensor_parallel 2: the main rank's tensor peer takes part in the validator's forward
    passes. Each evaluation is the torch backend's (tracked_run: its trackers change no value): the same greedy
    responses and rewards, and the same KL to the reference (0 for version 0, where the policy is the reference)."""
    result = reinforce("run", str(_spec(tmp_path, [], **MEGATRON_TP2)))
    assert result.returncode == 0, result.stderr[-3000:]
    evaluations, tables = {}, {}
    for name, run_dir in (("torch", tracked_run), ("megatron-tp2", tmp_path / "run")):
        paths = RunPaths(run_dir)
        evaluations[name] = [r for r in read_metrics(paths.metrics) if "val/rewards" in r]
        tables[name] = [
            [json.loads(line)["response"] for line in table.read_text().splitlines()]
            for table in sorted(paths.validation.glob("step-*.jsonl"))
        ]
    torch_rows, megatron_rows = evaluations["torch"], evaluations["megatron-tp2"]
    assert [r["step"] for r in megatron_rows] == [r["step"] for r in torch_rows] == [0, 2, 4, 5]
    assert tables["megatron-tp2"] == tables["torch"]
    assert megatron_rows[0]["val/init_policy_kl"] == 0.0
    for t, m in zip(torch_rows, megatron_rows, strict=True):
        assert m["val/rewards"] == pytest.approx(t["val/rewards"], abs=1e-6), m["step"]
        assert m["val/init_policy_kl"] == pytest.approx(t["val/init_policy_kl"], rel=1e-3, abs=1e-6), m["step"]


def assert_trackers_hold_the_metrics(run_dir: Path, rows: list[dict]) -> None:
    expected = {
        name: [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        for name in ("train_rollouts/rewards", "train_optim/loss", *VAL)
    }
    for name, got in (
        ("tensorboard", _tensorboard_scalars(run_dir / "tensorboard")),
        ("wandb", wandb_history(run_dir / "wandb")),
        ("mlflow", _mlflow_history(run_dir / "mlruns")),
    ):
        for metric, series in expected.items():
            assert [s for s, _ in got[metric]] == [s for s, _ in series], (name, metric)
            values = [v for _, v in got[metric]]
            assert values == pytest.approx([v for _, v in series], rel=1e-6, abs=1e-7), (name, metric)


def assert_trackers_hold_the_samples_once(run_dir: Path, steps: int) -> None:
    """Each step's samples file, and in each tracker one samples table per step: a redone step replaced its own."""
    # the reader TensorBoard's own text plugin uses (the older event_accumulator never purges text)
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    paths = RunPaths(run_dir)
    assert sample_steps(paths) == list(range(1, steps + 1))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    tensorboard = events.Tensors("samples/text_summary")
    assert [e.step for e in tensorboard] == list(range(1, steps + 1))
    assert (
        read_samples(paths, steps)[0]["response"].replace("|", "\\|")
        in tensorboard[-1].tensor_proto.string_val[0].decode()
    )
    # W&B keeps a table in its history as the table file's fields (samples/nrows, samples/path, ...)
    tables = [(step, items["samples/nrows"]) for step, items in wandb_history_steps(run_dir / "wandb")
              if "samples/nrows" in items]  # fmt: skip
    assert tables == [(step, 4) for step in range(1, steps + 1)]
    mlflow = sorted((run_dir / "mlruns").glob("*/*/artifacts/samples/step-*.jsonl"))
    assert [p.read_text() for p in mlflow] == [paths.samples_file(s).read_text() for s in range(1, steps + 1)]


def test_missing_tracker_extra_is_named(tmp_path):
    if all(_installed(m) for m in ("tensorboard", "wandb", "mlflow")):
        # simulate a machine without the wandb extra: an empty package directory that shadows it is not
        # enough for find_spec, so check the message from the function the supervisor calls
        from reinforce.core import trackers
        from reinforce.core.optional import MissingPackage

        saved = trackers.TRACKER_PACKAGES["wandb"]
        trackers.TRACKER_PACKAGES["wandb"] = ("wandb_not_installed_here", "wandb")
        try:
            with pytest.raises(MissingPackage, match=r"tracker 'wandb'.*reinforce-k8s\[wandb\]"):
                trackers.check_trackers(["wandb"])
        finally:
            trackers.TRACKER_PACKAGES["wandb"] = saved
        return
    result = reinforce("run", str(_spec(tmp_path, ["tensorboard", "wandb", "mlflow"])), timeout=120)
    assert result.returncode == 2 and "logging.trackers" in result.stderr and "pip install" in result.stderr


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow_history(folder: Path) -> dict[str, list[tuple[int, float]]]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=folder.resolve().as_uri())
    run_id = (folder / "reinforce_run_id").read_text().strip()
    metrics = client.get_run(run_id).data.metrics
    return {name: sorted((m.step, m.value) for m in client.get_metric_history(run_id, name)) for name in metrics}
