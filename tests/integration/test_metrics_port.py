"""A generator pod's metrics on a port of their own (R3-9): the runs' NetworkPolicies open that port to Prometheus
and keep the control plane closed, so the metrics port must serve metrics and nothing else. A real generator
process, started as the operator starts it (services/reinforce/operator/children.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port
from runs import write_spec

from reinforce.core import launch
from reinforce.core.generator_api import WEIGHTS_PATH
from reinforce.core.launch_flags import GeneratorFlags
from reinforce.core.names import CONTROL_TOKEN_ENV, REDIS_URL_ENV

TOKEN = "metrics-port-test-token"
START_TIMEOUT_S = 120  # importing torch and preparing the tiny policy on a shared core


def _get(url: str) -> httpx.Response | None:
    return _get_with(url, {})


def _get_with(url: str, headers: dict[str, str]) -> httpx.Response | None:
    """The answer, or None while nothing listens there."""
    try:
        return httpx.get(url, headers=headers, timeout=2)
    except httpx.HTTPError:
        return None


def test_a_generator_serves_its_metrics_on_their_own_port_and_nothing_else_there(
    tmp_path: Path, redis_url: str
) -> None:
    control, metrics = free_port(), free_port()
    flags = GeneratorFlags(reward_url="http://127.0.0.1:9", port=control, metrics_port=metrics, id="generator-0")
    argv = launch.GENERATOR.command(sys.executable, str(write_spec(tmp_path)), flags)
    env = {**os.environ, CONTROL_TOKEN_ENV: TOKEN, REDIS_URL_ENV: redis_url, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (scraped := _get(f"http://127.0.0.1:{metrics}/metrics")) is None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, f"no metrics on port {metrics} within {START_TIMEOUT_S} s"
            time.sleep(0.5)
        assert scraped.status_code == 200 and "reinforce_generator_weight_version" in scraped.text
        # the weight endpoint is the control port's alone
        auth = {"Authorization": f"Bearer {TOKEN}"}
        posted = httpx.post(f"http://127.0.0.1:{metrics}{WEIGHTS_PATH}", json={"version": 1}, headers=auth, timeout=2)
        assert posted.status_code >= 400
        # the metrics server starts before the control plane: the control port may answer a moment later
        while (weights := _get_with(f"http://127.0.0.1:{control}{WEIGHTS_PATH}", auth)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "the control plane never answered"
            time.sleep(0.5)
        assert weights.status_code == 200
    finally:
        proc.kill()  # the test needs no orderly stop
        proc.wait(timeout=30)
