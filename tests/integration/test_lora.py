"""LoRA (training.lora, PEFT on the torch backend) through real processes, on the torch engine (which merges each
version) and the vLLM engine (which loads each version as a vLLM LoRA adapter): the tiny run learns, every published
weight version holds only the adapters, the final model comes merged and as an adapter, and a killed trainer
resumes to bit-identical weights."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from runs import (
    assert_each_step_trained_once,
    assert_reward_rose,
    final_weights,
    needs_vllm,
    service_pids,
    start,
    wait_for_step,
    write_spec,
)
from safetensors import safe_open
from safetensors.torch import load_file

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

# The tiny task is learned through the output layer, so this model's is untied and adapted too.
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "lm_head"]}  # fmt: skip
TRAINING = {"steps": 24, "checkpoint_every": 8, "lr": 1.0e-2, "lora": LORA}
UNTIED = {"random_init": {"vocab": "abcdefghijklmnopqrstuvwxyz .,!?", "hidden_size": 32, "intermediate_size": 64,
                          "num_layers": 2, "num_heads": 2, "tie_word_embeddings": False}}  # fmt: skip
# vLLM's CPU attention needs heads of size 32: the same model with one head instead of two.
UNTIED_HEAD32 = {"random_init": {**UNTIED["random_init"], "num_heads": 1}}
# Mean |generator log-prob - trainer's| per step: the torch engine samples in float32 like the trainer; vLLM in
# bfloat16 (tests/runs.py's on_engine names it), whose rounding the vLLM engine tests bound
# (tests/integration/test_vllm_engine.py).
MISMATCH = {"torch": 1e-4, "vllm": 0.05}
KILL_AFTER = 12  # last checkpoint before it: step 8, so steps 9..12 are redone


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=needs_vllm)])
def test_lora_run_learns_ships_adapters_and_resumes_exactly(tmp_path, engine):
    """One run, its trainer killed after step 12 and restarted by the supervisor: the redone steps repeat the
    killed life's to the last bit (same samples, same updates), the reward rises, and every published weight
    version holds only the adapters."""
    policy = UNTIED if engine == "torch" else UNTIED_HEAD32
    proc = start("run", str(write_spec(tmp_path, training=TRAINING, policy=policy, generation={"engine": engine})))
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    wait_for_step(proc, run_dir, KILL_AFTER, timeout_s=900)
    os.kill(service_pids(run_dir, "reinforce.trainer")[0], signal.SIGKILL)
    first_life = {r["step"]: r for r in read_metrics(paths.metrics)}
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    assert "component trainer exited with code -9" in stderr
    assert_each_step_trained_once(run_dir, 24)
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 25))
    redone = [s for s in first_life if s > TRAINING["checkpoint_every"]]
    assert redone, "the trainer was killed before it redid any step"
    for step in redone:  # bit-identical: exact float equality of what the step computed
        for name in (
            "train_rollouts/rewards",
            "train_optim/loss",
            "train_optim/grad_norm",
            "train_rollouts/init_policy_kl",
        ):
            assert rows[step - 1][name] == first_life[step][name], (step, name)

    assert_reward_rose(rows)
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < MISMATCH[engine]  # generators apply the adapters
    print(f"{engine}: largest step log-prob mismatch {max(r['train_rollouts/logprob_mismatch'] for r in rows):.2e}")
    if engine == "vllm":
        assert "generation engine: vllm" in (paths.logs / "generator-0.log").read_text()
    assert rows[-1]["train_rollouts/init_policy_kl"] > 0  # reference = base with adapters disabled

    # every published version holds only adapters
    versions = sorted(paths.weights.glob("v*.safetensors"))
    base_bytes = (paths.initial_policy / "model.safetensors").stat().st_size
    assert versions
    for version in versions:
        with safe_open(str(version), framework="pt") as f:
            assert f.metadata()["format"] == "lora"
            assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())  # noqa: SIM118
        assert version.stat().st_size < base_bytes
    # merged final model and the adapter alone
    assert (paths.final_model / "adapter" / "adapter_model.safetensors").exists()
    merged = final_weights(run_dir)
    initial = load_file(paths.initial_policy / "model.safetensors")
    assert not all(torch.equal(v, initial[k]) for k, v in merged.items() if k in initial)
    print(f"LoRA version {versions[-1].stat().st_size} bytes; full model {base_bytes} bytes")
