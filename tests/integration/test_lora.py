"""LoRA (training.lora, PEFT on the torch backend) through real processes: the tiny run learns, every published
weight version holds only the adapters, the final model comes merged and as an adapter, and a killed trainer
resumes to bit-identical weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from runs import assert_each_step_trained_once, final_weights, reinforce, service_pids, start, wait_for_step, write_spec
from safetensors import safe_open

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]}  # fmt: skip
TRAINING = {"steps": 12, "checkpoint_every": 4, "lr": 2.0e-2, "lora": LORA}


def test_lora_run_learns_ships_adapters_and_resumes_exactly(tmp_path):
    # an uninterrupted run
    result = reinforce("run", str(write_spec(tmp_path / "a", training=TRAINING)))
    assert result.returncode == 0, result.stderr[-3000:]
    run_a = tmp_path / "a" / "run"
    paths = RunPaths(run_a)
    rows = read_metrics(paths.metrics)
    rewards = [r["train_rollouts/rewards"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < 1e-4  # generators merged the adapters
    assert rows[-1]["train_rollouts/init_policy_kl"] > 0  # reference = base with adapters disabled

    # every published version holds only adapters
    versions = sorted(paths.weights.glob("v*.safetensors"))
    assert versions
    base_bytes = (paths.initial_policy / "model.safetensors").stat().st_size
    for version in versions:
        with safe_open(str(version), framework="pt") as f:
            assert f.metadata()["format"] == "lora"
            assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())  # noqa: SIM118
        assert version.stat().st_size < base_bytes / 2
    # merged final model and the adapter alone
    assert (paths.final_model / "model.safetensors").exists()
    assert (paths.final_model / "adapter" / "adapter_model.safetensors").exists()
    merged = final_weights(run_a)
    assert not all(torch.equal(v, _initial(paths)[k]) for k, v in merged.items())
    print(f"LoRA version {versions[-1].stat().st_size} bytes; full model {base_bytes} bytes")

    # the same run, its trainer killed after step 6 (checkpoint at 4): restarted, it resumes to the same weights
    proc = start("run", str(write_spec(tmp_path / "b", training=TRAINING)))
    run_b = tmp_path / "b" / "run"
    wait_for_step(proc, run_b, 6)
    os.kill(service_pids(run_b, "reinforce.trainer")[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "component trainer exited with code -9" in stderr
    assert_each_step_trained_once(run_b, 12)
    wa, wb = final_weights(run_a), final_weights(run_b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "resumed LoRA run's weights differ"


def _initial(paths: RunPaths) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(paths.initial_policy) / "model.safetensors")
