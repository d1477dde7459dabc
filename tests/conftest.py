"""Shared fixtures: a real redis-server per test session. Other test files add their own fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from reinforce.supervisor.ports import free_port

if TYPE_CHECKING:
    from runs import FinishedRun

# The tests need nothing from the Hugging Face Hub (CI has no network): a lookup fails at once instead of after
# huggingface_hub's retries. Set before anything imports huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two xdist workers each run a pipeline on the same 2 cores: OpenMP threads that spin while they wait (libgomp's
# default where a run's processes take turns, supervisor/children.py) then spin on the core the other run needs,
# and both runs slow down (issue 42's note has the measurement). The children inherit it, as a user's own setting.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

# Scopes, shared session results and the time budget of `make test` (tests/suite_plan.py).
pytest_plugins = ["suite_plan"]


def _wait_for_ping(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server at {url} did not answer PING within {timeout_s} s")
    finally:
        client.close()


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    # The free port can be taken by another process before redis binds it: try a few.
    for _ in range(3):
        port = free_port()
        cmd = [REDIS_SERVER, "--save", "", "--appendonly", "no", "--port", str(port), "--dir", str(workdir)]
        cmd += ["--bind", "127.0.0.1", "--logfile", str(workdir / "redis.log")]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            _wait_for_ping(url, proc)
            return proc, url
        except RuntimeError:
            stop_process(proc)
    raise RuntimeError(f"could not start redis-server; see {workdir / 'redis.log'}")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (redis shuts down cleanly, and with --save "" writes nothing; a service drains), then SIGKILL after
    `timeout_s`; returns once the process is reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a throwaway redis-server (no persistence) that lives for the whole session."""
    proc, url = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_process(proc)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's redis URL, emptied before the test."""
    client = redis.Redis.from_url(redis_server)
    try:
        client.flushall()
    finally:
        client.close()
    yield redis_server


def whole_run(example: str, training: dict) -> Callable[[Path], Path]:
    """A build for shared_result: an uninterrupted run of examples/EXAMPLE.yaml with `training`; its run folder."""
    from runs import reinforce, write_spec

    def build(folder: Path) -> Path:
        result = reinforce("run", str(write_spec(folder, example, training=training)))
        assert result.returncode == 0, result.stderr[-3000:]
        return folder / "run"

    return build


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """examples/tiny.yaml as it is (30 steps) run to its end, in a folder named on the command line (`--run-dir`),
    not the spec's: a user's first run, which the pipeline and the run-folder commands' tests read. Run once per test
    run (shared by the workers)."""
    from runs import FinishedRun, reinforce, write_spec
    from suite_plan import shared_result

    def build(folder: Path) -> Path:
        run_dir = folder / "elsewhere"
        result = reinforce("run", str(write_spec(folder)), "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "stdout.txt").write_text(result.stdout)
        (folder / "stderr.txt").write_text(result.stderr)
        return run_dir

    run_dir = shared_result(tmp_path_factory, "tiny-run", build)
    printed = [(run_dir.parent / name).read_text() for name in ("stdout.txt", "stderr.txt")]
    return FinishedRun(run_dir, *printed)


@pytest.fixture(scope="session")
def tiny_baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted single-rank run of examples/tiny.yaml (runs.BASELINE_TRAINING): the reference that
    resumed, restarted and data-parallel runs must reproduce. Run once per test run (shared by the workers)."""
    from runs import BASELINE_TRAINING
    from suite_plan import shared_result

    return shared_result(tmp_path_factory, "baseline", whole_run("tiny", BASELINE_TRAINING))


@pytest.fixture(scope="session")
def tiny_megatron_baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of examples/tiny.yaml on the Megatron backend over two tensor-parallel ranks
    (runs.BASELINE_TRAINING, runs.MEGATRON_TP2): what a resumed Megatron run must reproduce bit for bit."""
    from runs import BASELINE_TRAINING, MEGATRON_TP2
    from suite_plan import shared_result

    training = {**BASELINE_TRAINING, **MEGATRON_TP2}
    return shared_result(tmp_path_factory, "megatron-baseline", whole_run("tiny", training))


@pytest.fixture(scope="session")
def tiny_ppo_baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of examples/tiny-ppo.yaml (runs.BASELINE_TRAINING): what PPO runs with a killed critic
    or a resume must reproduce."""
    from runs import BASELINE_TRAINING
    from suite_plan import shared_result

    return shared_result(tmp_path_factory, "ppo-baseline", whole_run("tiny-ppo", BASELINE_TRAINING))


@pytest.fixture(scope="session")
def tiny_head32_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny example's random Llama with one head of size 32: the smallest shape vLLM's CPU attention runs."""
    from reinforce.core.policy import materialize_policy
    from reinforce.core.spec import PolicySpec, RandomInit

    spec = PolicySpec(random_init=RandomInit(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=1))
    return materialize_policy(spec, tmp_path_factory.mktemp("policy") / "tiny", seed=0)
