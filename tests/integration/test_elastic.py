"""Elastic generators: one told to stop (SIGTERM, a scale-in) hands its claimed prompts to the others at once.

Real Redis, a real reward server and real generator processes, as the supervisor and the operator start them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from runs import write_spec

from reinforce.core import launch
from reinforce.core.launch_flags import GeneratorFlags, RewardFlags
from reinforce.core.names import CONTROL_TOKEN_ENV, REDIS_URL_ENV
from reinforce.core.queue import GENERATORS_GROUP, RolloutQueue, connect
from reinforce.core.records_pb2 import Prompt, WeightVersion
from reinforce.core.spec import dump_spec, load_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    """examples/tiny.yaml resolved into a spec file, as the supervisor writes RUN_DIR/spec.yaml; reclaim_idle_s is
    the default 60 s, far longer than the test waits."""
    spec = load_spec(write_spec(tmp_path, generation={"num_generators": 2}))
    assert spec.generation.reclaim_idle_s == 60
    path = tmp_path / "spec.yaml"
    path.write_text(dump_spec(spec))
    return path


@pytest.fixture
def reward_url(spec_file: Path, tmp_path: Path) -> Iterator[str]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    flags = RewardFlags(http_port=http, grpc_port=grpc, metrics_port=metrics)
    argv = launch.REWARD.command(sys.executable, str(spec_file), flags)
    with (tmp_path / "reward.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{http}"
    wait_until(lambda: _ok(url + launch.REWARD.ready_path), 120, proc)
    yield url
    proc.terminate()
    proc.wait(30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(condition, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    start = time.monotonic()
    while not condition():
        assert proc is None or proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.1)
    return time.monotonic() - start


def start_generator(spec_file: Path, redis_url: str, reward_url: str, name: str, log: Path) -> subprocess.Popen:
    port = free_port()
    argv = launch.GENERATOR.command(
        sys.executable, str(spec_file), GeneratorFlags(reward_url=reward_url, port=port, id=name)
    )
    env = {**os.environ, REDIS_URL_ENV: redis_url, CONTROL_TOKEN_ENV: "control-token"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: _ok(f"http://127.0.0.1:{port}{launch.GENERATOR.ready_path}"), 120, proc)
    return proc


def owners(queue: RolloutQueue) -> dict[str, int]:
    """Pending prompts per generator."""
    info = queue.client.xpending(queue.prompts_key, GENERATORS_GROUP)
    return {c["name"].decode(): int(c["pending"]) for c in info["consumers"]}


def test_a_stopping_generator_hands_back_its_prompts_at_once(
    spec_file: Path, redis_url: str, reward_url: str, tmp_path: Path
) -> None:
    spec = load_spec(spec_file)
    queue = RolloutQueue(connect(redis_url), spec.name)
    queue.delete_run_keys()
    queue.ensure_groups()
    # Version 1 is published but no reconciler asks anyone to load it: the prompts that need it stay claimed,
    # unacknowledged, by the generator that read them, as a step's prompts wait for its weights.
    queue.publish_weights(WeightVersion(version=1, uri="/not/loaded", sha256="0" * 64))
    queue.put_prompts([Prompt(id=f"1-{i}", step=1, policy_version=1, token_ids=[1, 2], seed=i) for i in range(4)])
    first = start_generator(spec_file, redis_url, reward_url, "gen-a", tmp_path / "gen-a.log")
    wait_until(lambda: owners(queue).get("gen-a") == 4, 60, first)
    second = start_generator(spec_file, redis_url, reward_url, "gen-b", tmp_path / "gen-b.log")
    try:
        first.send_signal(signal.SIGTERM)  # a scale-in: the Deployment deletes the pod
        assert first.wait(30) == 0
        taken = wait_until(lambda: owners(queue).get("gen-b") == 4, 10, second)
        assert taken < 10 < spec.generation.reclaim_idle_s  # not the idle-reclaim timeout
        assert "stopping: handed back 4 prompts" in (tmp_path / "gen-a.log").read_text()
        assert "reclaimed 4 prompts" in (tmp_path / "gen-b.log").read_text()
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        queue.client.close()
