"""Helpers for tests that drive `reinforce run` on the tiny example through real processes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
import torch
import yaml
from transformers import AutoModelForCausalLM

from reinforce.core.metrics import read_metrics
from reinforce.core.queue import RolloutQueue
from reinforce.core.run_dir import RunPaths

EXAMPLES = Path(__file__).parent.parent / "examples"
# The training section of the `tiny_baseline` run (tests/conftest.py) that other runs are compared with.
BASELINE_TRAINING = {"steps": 12, "checkpoint_every": 4}
# The training settings that put the tiny example on the Megatron backend, split over two tensor-parallel ranks.
MEGATRON_TP2 = {"backend": "megatron", "tensor_parallel": 2, "num_ranks": 2}


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (`make install` installs its CPU build)"
)


@dataclass(frozen=True)
class FinishedRun:
    """A `reinforce run` that ended well: its run folder and what it printed."""

    run_dir: Path
    stdout: str
    stderr: str


def on_engine(engine: str, **overrides: dict) -> dict[str, dict]:
    """`overrides` for write_spec with generation.engine set; vLLM's CPU attention needs the tiny policy's heads to
    be of size 32 (one head instead of two), and vLLM samples in bfloat16 on every machine (its dtype auto is float32
    without bfloat16 hardware): the tests' mismatch bounds are bfloat16's."""
    overrides = {**overrides, "generation": {**overrides.get("generation", {}), "engine": engine}}
    if engine == "vllm":
        overrides["generation"].setdefault("dtype", "bfloat16")
        tiny = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())["policy"]
        overrides["policy"] = {"random_init": {**tiny["random_init"], "num_heads": 1}}
    return overrides


def write_spec(folder: Path, example: str = "tiny", **overrides: dict) -> Path:
    """examples/EXAMPLE.yaml with its run folder in `folder` and any sections updated from `overrides`."""
    spec = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    spec["run_dir"] = str(folder / "run")
    spec["data"]["prompts"] = str(EXAMPLES / spec["data"]["prompts"])
    for section, values in overrides.items():
        spec.setdefault(section, {}).update(values)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{example}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def reinforce(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`reinforce ARGS` to its end (`env`: its whole environment; default: this process's)."""
    argv = [sys.executable, "-m", "reinforce", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`reinforce ARGS` in the background (`env`: its whole environment; default: this process's)."""
    return subprocess.Popen(
        [sys.executable, "-m", "reinforce", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def kill_run(proc: subprocess.Popen) -> None:
    """Kill a started `reinforce run` and every process under it. Not `psutil.Process().children()`: the session's
    own servers (its Redis) are this test process's children too."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        for process in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    proc.wait()


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(RunPaths(run_dir).final_model).state_dict()


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = final_weights(a), final_weights(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def assert_reward_rose(rows: list[dict], window: int = 5, by: float = 0.1) -> None:
    """The mean reward of the last `window` steps exceeds that of the first by `by`."""
    rewards = [r["train_rollouts/rewards"] for r in rows]
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    assert last > first + by, f"reward did not rise: {first:.3f} -> {last:.3f}"


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while (rows := read_metrics(RunPaths(run_dir).metrics)) == [] or rows[-1]["step"] < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s}s"
        time.sleep(0.2)


def service_pids(run_dir: Path, module: str = "", name: str = "") -> list[int]:
    """PIDs of the run's Python services (each is given RUN_DIR/spec.yaml), optionally of one module and name
    (`python -m MODULE --spec RUN_DIR/spec.yaml ... --id NAME`)."""
    pattern = f"{module}.*{run_dir}/spec.yaml.*{name}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def service_of(process: psutil.Process) -> str:
    """`reinforce.generator` and the like for the run's Python services; the program's name for anything else."""
    argv = process.cmdline()
    return argv[argv.index("-m") + 1] if "-m" in argv else process.name()


def flag(process: psutil.Process, name: str) -> str:
    """The value given to a process's command-line flag `name`."""
    argv = process.cmdline()
    return argv[argv.index(name) + 1]


def run_queue(run_dir: Path) -> tuple[redis.Redis, RolloutQueue]:
    """A client of the run's Redis (its address and password from RUN_DIR/redis/redis.conf) and the run's keys."""
    conf = run_dir / "redis" / "redis.conf"
    config = dict(line.split(maxsplit=1) for line in conf.read_text().splitlines() if " " in line)
    name = yaml.safe_load((run_dir / "spec.yaml").read_text())["name"]
    client = redis.Redis(port=int(config["port"]), password=config["requirepass"], socket_timeout=10)
    return client, RolloutQueue(client, name)


def redis_pid(run_dir: Path) -> int:
    """redis-server rewrites its title to `redis-server 127.0.0.1:PORT`; the port is in the run's config."""
    config = (run_dir / "redis" / "redis.conf").read_text()
    port = next(line.split()[1] for line in config.splitlines() if line.startswith("port "))
    found = subprocess.run(["pgrep", "-f", f"redis-server 127.0.0.1:{port}"], capture_output=True, text=True)
    [pid] = found.stdout.split()
    return int(pid)


def assert_each_step_trained_once(run_dir: Path, steps: int, prompts_per_step: int = 8) -> None:
    """The audit trail: steps 1..N, each on its own N prompts, and no prompt id twice."""
    rows = [json.loads(line) for line in RunPaths(run_dir).trained_groups.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert sorted(r["prompt_ids"]) == sorted(f"{r['step'] - 1}-{i}" for i in range(prompts_per_step))


def assert_lost_samples_audited(run_dir: Path) -> int:
    """Every sample a step left out for a non-finite reward is named in the audit trail under its prompt; returns
    how many were."""
    audit = [json.loads(line) for line in RunPaths(run_dir).trained_groups.read_text().splitlines()]
    rows = {row["step"]: row for row in read_metrics(RunPaths(run_dir).metrics)}
    for entry in audit:
        lost = entry.get("nonfinite_reward_samples", {})
        assert set(lost) <= set(entry["prompt_ids"]), entry
        assert sum(lost.values()) == rows[entry["step"]]["train_rollouts/dropped_nonfinite_rewards"], entry
    return sum(sum(e.get("nonfinite_reward_samples", {}).values()) for e in audit)


# The algorithm section of each recipe on the tiny example (benchmarks/algorithms.py, test_pipeline.py): the peers'
# recipes as docs/algorithms.md's "Algorithm recipes" names them.
RECIPES: dict[str, dict] = {
    "rloo": {},
    "grpo": {"advantage_estimator": "grpo"},
    "dr_grpo": {"advantage_estimator": "dr_grpo", "loss_aggregation": "constant"},
    "dapo": {
        "advantage_estimator": "grpo",
        "initial_policy_kl_penalty": 0.0,
        "policy_loss": "clip",
        "ratio_eps_low": 0.2,
        "ratio_eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_buffer": 4,
    },
    "gspo": {"advantage_estimator": "grpo", "policy_loss": "gspo", "loss_aggregation": "sequence_mean"},
}
