"""Nothing lost when anything dies, one fault per run where the fault needs a setting of its own: a trainer rank
killed with restarts off, a generator killed while another can reclaim its prompts, the environment service of a
multi-turn run (examples/tiny-tools.yaml); PPO runs (examples/tiny-ppo.yaml) survive their critic's death and a kill
of the whole process tree, bit-identically. Kills of the trainer, the generator, the reward server and Redis, stalls
and kills of the whole tree on the tiny example are the fault campaign's (tests/integration/test_fault_campaign.py)."""

import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from runs import (
    BASELINE_TRAINING,
    MEGATRON_TP2,
    assert_each_step_trained_once,
    max_weight_difference,
    needs_vllm,
    on_engine,
    redis_pid,
    reinforce,
    run_queue,
    service_pids,
    start,
    wait_for_step,
    write_spec,
)

from reinforce.core.metrics import read_metrics
from reinforce.core.queue import GENERATORS_GROUP
from reinforce.core.run_dir import RunPaths

pytestmark = pytest.mark.slow
STEPS = BASELINE_TRAINING["steps"]
SHORT = BASELINE_TRAINING


def kill_mid_run(proc, run_dir: Path, pid_of, step: int | None = None) -> int:
    """SIGKILL the process `pid_of()` returns once `step` (default: a random one) is trained."""
    step = step or random.Random(os.getpid()).randint(2, STEPS - 3)
    wait_for_step(proc, run_dir, step)
    os.kill(pid_of(), signal.SIGKILL)
    return step


def held_prompts(run_dir: Path, consumer: str) -> int:
    """Prompts `consumer` has read and not acknowledged (its pending entries in the run's Redis)."""
    client, queue = run_queue(run_dir)
    with client:
        return len(client.xpending_range(queue.prompts_key, GENERATORS_GROUP, "-", "+", 1000, consumername=consumer))


def kill_holding_prompts(proc, run_dir: Path, generator: str) -> None:
    """SIGKILL `generator` mid-run at a moment it holds prompts, which another generator must then reclaim. Frozen
    (SIGSTOP) while its pending entries are counted, so it cannot acknowledge them between the count and the kill."""
    wait_for_step(proc, run_dir, random.Random(os.getpid()).randint(2, STEPS - 3))
    [pid] = service_pids(run_dir, name=f"--id {generator}")
    deadline = time.monotonic() + 120
    while True:
        os.kill(pid, signal.SIGSTOP)
        if held_prompts(run_dir, generator):
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)
        assert proc.poll() is None and time.monotonic() < deadline, f"{generator} never held a prompt"
        time.sleep(0.02)


def test_killed_trainer_rank_stops_the_run_and_resumes_to_identical_weights(tmp_path, tiny_megatron_baseline):
    """kill -9 the last rank of a Megatron trainer under torchrun with restarts off: the run stops, naming the
    trainer (torchrun stops the other rank and exits with 1 itself), and leaves no process behind; `reinforce run
    --resume` finishes it from the sharded checkpoint, every rank its own shard, with bit-identical weights. (The
    torch backend's resumes are the fault campaign's, tests/integration/test_fault_campaign.py.)"""
    spec = write_spec(tmp_path, training={**SHORT, **MEGATRON_TP2}, restart={"max_restarts": 0})
    proc = start("run", str(spec))
    run_dir = tmp_path / "run"
    # the newest trainer process: the only one without torchrun, the last rank under it (the launcher is older)
    killed_at = kill_mid_run(proc, run_dir, lambda: max(service_pids(run_dir, "reinforce.trainer")))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "component trainer exited with code 1" in stderr
    assert service_pids(run_dir) == [], "the supervisor left processes behind"

    result = reinforce("run", "--resume", str(run_dir))
    assert result.returncode == 0, f"killed after step {killed_at}: {result.stderr[-3000:]}"
    diff = max_weight_difference(tiny_megatron_baseline, run_dir)
    assert diff == 0.0, f"killed after step {killed_at}: weights differ by {diff}"  # bit-identical
    assert_each_step_trained_once(run_dir, STEPS)
    rewards = [r["train_rollouts/rewards"] for r in read_metrics(RunPaths(run_dir).metrics)]
    assert rewards == pytest.approx(
        [r["train_rollouts/rewards"] for r in read_metrics(RunPaths(tiny_megatron_baseline).metrics)]
    )


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=needs_vllm)])
def test_killed_generator_prompts_are_reclaimed_by_the_other(tmp_path, engine):
    # The dead generator's restart comes late (60 s back-off), so the living one must reclaim its prompts.
    spec = write_spec(tmp_path, **on_engine(
        engine, training=SHORT, generation={"num_generators": 2, "reclaim_idle_s": 2.0},
        restart={"backoff_s": 60.0, "max_backoff_s": 60.0},
    ))  # fmt: skip
    proc = start("run", str(spec))
    run_dir = tmp_path / "run"
    kill_holding_prompts(proc, run_dir, "generator-1")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "reclaimed" in (RunPaths(run_dir).logs / "generator-0.log").read_text()
    assert_each_step_trained_once(run_dir, STEPS)


def test_killed_critic_is_restarted_and_the_ppo_run_ends_exactly(tmp_path, tiny_ppo_baseline):
    """kill -9 the critic: the supervisor restarts it from its last checkpoint; the trainer notices the critic's lost
    steps (or a lost /v1/train answer), stops, is restarted and redoes the steps since its checkpoint."""
    proc = start("run", str(write_spec(tmp_path, "tiny-ppo", training=SHORT)))
    run_dir = tmp_path / "run"
    # two steps after a checkpoint: the restarted critic has lost two steps' updates, which the trainer must notice
    step = SHORT["checkpoint_every"] + 2
    killed_at = kill_mid_run(proc, run_dir, lambda: service_pids(run_dir, "reinforce.critic")[0], step=step)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "component critic exited with code -9; restart 1 of 3" in stderr
    assert "component trainer exited with code 1; restart 1 of 3" in stderr
    trainer_log = (RunPaths(run_dir).logs / "trainer.log").read_text()
    # the critic's lost steps, or a /v1/train answer the kill cut off: which one depends on when the kill lands
    assert "CriticError" in trainer_log, trainer_log[-3000:]
    assert_each_step_trained_once(run_dir, STEPS)
    diff = max_weight_difference(tiny_ppo_baseline, run_dir)
    assert diff < 1e-6, f"critic killed after step {killed_at}: weights differ by {diff}"


def test_killed_ppo_run_resumes_to_identical_weights(tmp_path, tiny_ppo_baseline):
    """kill -9 of the whole process tree (supervisor, every service, Redis), then `reinforce run --resume`."""
    proc = start("run", str(write_spec(tmp_path, "tiny-ppo", training=SHORT)))
    run_dir = tmp_path / "run"
    killed_at = random.Random(os.getpid()).randint(2, STEPS - 3)
    wait_for_step(proc, run_dir, killed_at)
    proc.kill()
    # each component runs in its own process group (Triton is a grandchild of the reward server's)
    for pid in [*service_pids(run_dir), redis_pid(run_dir)]:
        os.killpg(pid, signal.SIGKILL)
    proc.communicate(timeout=60)

    result = reinforce("run", "--resume", str(run_dir))
    assert result.returncode == 0, f"killed after step {killed_at}: {result.stderr[-3000:]}"
    diff = max_weight_difference(tiny_ppo_baseline, run_dir)
    assert diff < 1e-6, f"killed after step {killed_at}: weights differ by {diff}"
    assert_each_step_trained_once(run_dir, STEPS)
    critic = [r["train_optim/critic_loss"] for r in read_metrics(RunPaths(run_dir).metrics)]
    assert critic == [r["train_optim/critic_loss"] for r in read_metrics(RunPaths(tiny_ppo_baseline).metrics)]


def test_killed_environment_service_is_restarted_and_its_groups_redone(tmp_path):
    """kill -9 the environment service of a multi-turn run (examples/tiny-tools.yaml): the supervisor restarts it on
    its port; a generator whose batch it broke (its episodes are gone) samples the whole batch again, so every step
    still trains once on its own prompts."""
    proc = start("run", str(write_spec(tmp_path, "tiny-tools", training=SHORT)))
    run_dir = tmp_path / "run"
    wait_for_step(proc, run_dir, 3)
    wait_for_open_episodes(run_dir)  # mid-batch: a generator's episodes are open
    os.kill(service_pids(run_dir, "reinforce.environment")[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "component environment exited with code -9; restart 1 of 3" in stderr
    assert "environment service failed" in (run_dir / "logs" / "generator-0.log").read_text()
    assert_each_step_trained_once(run_dir, STEPS)


def wait_for_open_episodes(run_dir: Path, timeout_s: float = 60) -> None:
    """Until the environment service (its address from RUN_DIR/prometheus_targets.json) has an episode open."""
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    [address] = [t["targets"][0] for t in targets if t["labels"]["component"] == "environment"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"http://{address}/metrics").text
        if any(
            line.startswith("reinforce_environment_open_episodes ") and float(line.split()[1]) > 0
            for line in metrics.splitlines()
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"no episode open in {timeout_s}s")
