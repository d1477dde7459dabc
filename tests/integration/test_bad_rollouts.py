"""A failing reward and a NaN rollout group inside real tiny runs (issue 30: R3-1, R3-2).

- A `module:function` reward that raises for ~6 s: the run ends with exit 0, the steps whose samples were all
  dropped are recorded as skipped, and `--resume` on the folder (its rows hold nulls) starts and ends.
- Asynchronous mode with a forged group of NaN log-probs pushed into the rollouts stream: it is dead-lettered with
  its reason, and every published weight version and every checkpoint stays finite.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from runs import (
    assert_each_step_trained_once,
    assert_lost_samples_audited,
    reinforce,
    run_queue,
    service_pids,
    start,
    wait_for_step,
    write_spec,
)
from safetensors.torch import load_file

from reinforce.core.metrics import read_metrics
from reinforce.core.queue import DATA_FIELD, RolloutQueue
from reinforce.core.records_pb2 import Prompt, RolloutGroup, Sample
from reinforce.core.run_dir import RunPaths

pytestmark = pytest.mark.slow
STEPS = 12

FLAKY_REWARD = '''
import time
from pathlib import Path


def flaky(prompts, responses, until_file):
    """The tiny example's reward, except while `until_file` holds a unix time still to come: then it raises."""
    until = Path(until_file)
    if until.exists() and time.time() < float(until.read_text()):
        raise RuntimeError("the reward backend is down")
    return [r.count("a") / len(r) if r else 0.0 for r in responses]
'''


def test_a_reward_that_raises_for_seconds_does_not_end_the_run_and_resume_reads_null_rows(tmp_path: Path) -> None:
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    until = tmp_path / "until"
    reward = {"function": "flaky_reward:flaky", "kwargs": {"until_file": str(until)}}
    spec = write_spec(tmp_path, reward=reward, training={"steps": STEPS, "checkpoint_every": 4})
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = start("run", str(spec), env=env)
    wait_for_step(proc, run_dir, 3)
    until.write_text(str(time.time() + 6))
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]

    rows = [r for r in read_metrics(RunPaths(run_dir).metrics) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    skipped = [r["step"] for r in rows if r.get("train_optim/skipped_empty_steps")]
    assert skipped, "no step lost all its rewards: the reward did not fail long enough"
    assert all(rows[s - 1]["train_rollouts/rewards"] is None for s in skipped)
    assert_each_step_trained_once(run_dir, STEPS)
    assert assert_lost_samples_audited(run_dir) >= len(skipped) * 8 * 4  # a skipped step's 8 prompts, 4 samples each

    # --resume reads the earlier metrics (rows with nulls among them) before the trainer starts
    last = rows[-1]
    last.update({"train_rollouts/rewards": None, "train_rollouts/init_policy_kl": None})
    lines = RunPaths(run_dir).metrics.read_text().splitlines()
    RunPaths(run_dir).metrics.write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    resumed = reinforce("run", "--resume", str(run_dir), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reward" in resumed.stdout and "-> -" in resumed.stdout


def _forge_nan_groups(client: redis.Redis, queue: RolloutQueue, k: int) -> int:
    """A group of NaN log-probs for every prompt still waiting in the prompts stream (a sampler stopped mid-way
    has not answered them), pushed ahead of the genuine ones."""
    forged = 0
    for _, fields in client.xrange(queue.prompts_key):
        prompt = Prompt.FromString(fields[DATA_FIELD])
        samples = [Sample(token_ids=[5, 6], logprobs=[float("nan")] * 2, reward=1.0, is_end=True) for _ in range(k)]
        group = RolloutGroup(prompt_id=prompt.id, step=prompt.step, policy_version=prompt.policy_version,
                             prompt_text=prompt.text, prompt_token_ids=prompt.token_ids, samples=samples)  # fmt: skip
        client.xadd(queue.rollouts_key, {DATA_FIELD: group.SerializeToString()})
        forged += 1
    return forged


def _dead_letter_reasons_while_running(
    proc, client: redis.Redis, queue: RolloutQueue, timeout_s: float = 120
) -> list[str]:
    """The dead-letter stream's reasons once it has one (the run's Redis stops with the run)."""
    deadline = time.monotonic() + 120
    while not (letters := client.xrange(queue.deadletter_key)):
        assert proc.poll() is None, "the run ended before any group was dead-lettered"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return [fields[b"reason"].decode() for _, fields in letters]


def _all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(t.float()).all() for t in tensors.values())


def test_a_nan_logprob_group_in_asynchronous_mode_is_dead_lettered_and_nothing_published_is_nan(tmp_path) -> None:
    spec = write_spec(
        tmp_path,
        algorithm={"max_policy_lag": 1},
        training={"steps": STEPS, "checkpoint_every": 2, "keep_checkpoints": STEPS},
        weights={"keep_versions": STEPS + 1},
    )
    run_dir = tmp_path / "run"
    proc = start("run", str(spec))
    wait_for_step(proc, run_dir, 4)
    [generator] = service_pids(run_dir, "reinforce.generator")
    client, queue = run_queue(run_dir)
    os.kill(generator, signal.SIGSTOP)
    try:
        assert _forge_nan_groups(client, queue, k=4) > 0
    finally:
        os.kill(generator, signal.SIGCONT)
    reasons = _dead_letter_reasons_while_running(proc, client, queue)
    assert any("a log-prob that is NaN" in r for r in reasons), reasons
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]

    paths = RunPaths(run_dir)
    rows = read_metrics(paths.metrics)
    assert sum(r.get("train_rollouts/invalid_groups") or 0 for r in rows) >= 1
    assert all(r["train_optim/grad_norm"] is not None for r in rows if r["step"] > 0)
    versions = sorted(paths.weights.glob("v*.safetensors"))
    assert len(versions) == STEPS + 1 and all(_all_finite(load_file(v)) for v in versions)
    checkpoints = sorted(paths.checkpoints.glob("step-*"))
    assert len(checkpoints) == STEPS // 2
    for checkpoint in checkpoints:
        assert all(_all_finite(load_file(f)) for f in checkpoint.glob("*.safetensors"))
    assert_each_step_trained_once(run_dir, STEPS)
