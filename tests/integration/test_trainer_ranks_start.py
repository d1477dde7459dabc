"""Trainer ranks that start with no supervisor to prepare their run folder, as trainer pods do: each rank would
build the initial policy itself. Under a process group transformers writes a model's weights from rank 0 only, so
another rank's build lacked them and, renamed into place, left a policy folder no rank could load (seen on the
cluster: two trainer pods crash-looping). The main rank now builds it and the others wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from runs import write_spec

from reinforce.core.names import REDIS_URL_ENV, WEIGHTS_TOKEN_ENV
from reinforce.core.run_dir import RunPaths
from reinforce.supervisor.ports import free_port


def test_two_ranks_build_one_loadable_initial_policy(tmp_path: Path, redis_url: str) -> None:
    spec_file = write_spec(tmp_path, training={"num_ranks": 2}, weights={"transport": "http"})
    env = {**os.environ, REDIS_URL_ENV: redis_url, WEIGHTS_TOKEN_ENV: "test-token"}
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        f"--master-port={free_port()}", "-m", "reinforce.trainer", "--spec", str(spec_file),
        "--weights-port", str(free_port()), "--stay-up",
    ]  # fmt: skip
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        trainer = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # Both ranks past loading: the main one then serves the weights and waits for rollouts (no generators here).
        deadline = time.monotonic() + 120
        while "serving weights at" not in log.read_text() and time.monotonic() < deadline:
            assert trainer.poll() is None, f"the trainer ranks exited:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        time.sleep(3)  # a rank that failed to load would have exited by now
        assert trainer.poll() is None, f"the trainer ranks exited:\n{log.read_text()[-3000:]}"
        assert "Error" not in log.read_text(), log.read_text()[-3000:]
    finally:
        trainer.terminate()
        trainer.wait(timeout=60)
    policy = RunPaths(tmp_path / "run").initial_policy
    assert {"config.json", "model.safetensors"} <= {p.name for p in policy.iterdir()}
