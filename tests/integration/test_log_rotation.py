"""Issue #30, R3-17: a reward function that prints 2 MB per call inside a tiny `reinforce run`; the supervisor keeps
its log near `logging.max_component_log_mb` (one older copy beside it) instead of letting it grow without bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from runs import write_spec

from reinforce.core.run_dir import RunPaths

pytestmark = pytest.mark.slow
CHATTY_REWARD = '''
from pathlib import Path


def chatty(prompts, responses, calls_file):
    """The tiny example's reward, printing 2 MB per call (and counting its calls)."""
    with open(calls_file, "a") as calls:
        calls.write("call\\n")
    print("x" * (2 << 20), flush=True)
    return [r.count("a") / len(r) if r else 0.0 for r in responses]
'''


def test_a_chatty_components_log_is_rotated_by_size(tmp_path: Path) -> None:
    (tmp_path / "chatty_reward.py").write_text(CHATTY_REWARD)
    calls = tmp_path / "calls"
    spec = write_spec(
        tmp_path,
        reward={"type": "python", "function": "chatty_reward:chatty", "kwargs": {"calls_file": str(calls)}},
        training={"steps": 5},
        logging={"max_component_log_mb": 1.0},
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "reinforce", "run", str(spec)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = len(calls.read_text().splitlines()) * (2 << 20)
    log = RunPaths(tmp_path / "run").logs / "reward.log"
    kept = [log.stat().st_size, log.with_name("reward.log.1").stat().st_size]
    assert sum(kept) < written / 2, (written, kept)  # without rotation the log would hold all of it
    assert max(kept) < 6 << 20, kept  # the cap (1 MiB) plus what arrived between two checks
