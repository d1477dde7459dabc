"""The whole pipeline through real processes: `reinforce run` on the tiny example.

redis-server, the Triton reward server, a generator and the trainer each run as their own process.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

EXAMPLES = Path(__file__).parent.parent / "examples"


def write_spec(tmp_path: Path, **overrides) -> Path:
    spec = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    spec["run_dir"] = str(tmp_path / "run")
    spec["data"]["prompts"] = str(EXAMPLES / spec["data"]["prompts"])
    for section, values in overrides.items():
        spec[section].update(values)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def reinforce(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reinforce.supervisor", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_tiny_run_learns(tmp_path):
    result = reinforce("run", str(write_spec(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 31))
    rewards = [r["train_rollouts/rewards"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f}"
    # on-policy with the same torch code on both sides: the generator's log-probs are the trainer's
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < 1e-4
    assert all(r["train_rollouts/policy_lag"] == 0 for r in rows)

    initial = load_file(paths.initial_policy / "model.safetensors")
    final = AutoModelForCausalLM.from_pretrained(paths.final_model).state_dict()
    changed = [name for name, t in initial.items() if not torch.equal(t, final[name])]
    assert len(changed) > len(initial) // 2, "the policy's weights barely changed"
    assert paths.plot.stat().st_size > 1000
    assert (paths.checkpoints / "step-000030").is_dir()


def test_bad_spec_names_the_field(tmp_path):
    path = write_spec(tmp_path, training={"lr": -1.0, "stepz": 3})
    result = reinforce("run", str(path), timeout=120)
    assert result.returncode == 2
    assert "training.lr" in result.stderr and "training.stepz" in result.stderr


def test_bad_prompt_file_names_file_and_line(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    path = write_spec(tmp_path, data={"prompts": str(prompts)})
    result = reinforce("run", str(path), timeout=120)
    assert result.returncode == 2
    assert f"{prompts}:2" in result.stderr
