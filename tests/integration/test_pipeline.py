"""The whole pipeline through real processes: `reinforce run` on the tiny example.

redis-server, the Triton reward server, a generator and the trainer each run as their own process.
"""

import json
import re

import pytest
import torch
from runs import (
    BASELINE_TRAINING,
    MEGATRON_TP2,
    assert_each_step_trained_once,
    assert_reward_rose,
    max_weight_difference,
    needs_vllm,
    on_engine,
    reinforce,
    write_spec,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from reinforce.core.metrics import read_metrics
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import load_spec


@pytest.mark.slow
def test_tiny_run_learns(tiny_run):
    result = tiny_run
    # generation.engine auto: vLLM cannot run the tiny policy's heads of 16 on CPU, so the run samples with torch
    assert "generation engine torch (float32; auto: vLLM's CPU attention does not run the policy's head size 16)" in (
        result.stdout
    )
    assert "Writing model shards" not in result.stdout + result.stderr  # "preparing the initial policy" says it
    paths = RunPaths(tiny_run.run_dir)
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert_reward_rose(rows)
    # on-policy with the same torch code on both sides: the generator's log-probs are the trainer's
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < 1e-4
    assert all(r["train_rollouts/policy_lag"] == 0 for r in rows)

    initial = load_file(paths.initial_policy / "model.safetensors")
    final = AutoModelForCausalLM.from_pretrained(paths.final_model).state_dict()
    changed = [name for name, t in initial.items() if not torch.equal(t, final[name])]
    assert len(changed) > len(initial) // 2, "the policy's weights barely changed"
    assert paths.plot.stat().st_size > 1000
    assert (paths.checkpoints / "step-000030").is_dir()


@pytest.mark.slow
@needs_vllm
def test_tiny_run_learns_with_vllm_sampling_in_bfloat16(tmp_path):
    """The same run with vLLM as the generators' engine, which generation.engine auto (the default) picks for a
    policy whose heads vLLM's CPU attention runs: it learns, and the trainer sees and corrects the bf16 engine's small
    log-prob mismatch (truncated importance weights, on by default for engines other than torch)."""
    overrides = on_engine("vllm")
    del overrides["generation"]["engine"]  # the default chooses it
    result = reinforce("run", str(write_spec(tmp_path, **overrides)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generation engine vllm (bfloat16; auto: vLLM is installed and runs it)" in result.stdout
    paths = RunPaths(tmp_path / "run")
    assert load_spec(paths.spec).generation.engine == "vllm", "the choice is not in the run folder's spec"
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert_reward_rose(rows)
    mismatch = [r["train_rollouts/logprob_mismatch"] for r in rows]
    assert 1e-5 < max(mismatch) < 0.05, mismatch  # bf16 sampling, fp32 training: small but not float32 noise
    assert all(r["train_rollouts/importance_weight_mean"] > 0.9 for r in rows)  # the correction ran, and barely bit
    assert sum(r["train_rollouts/refused_mismatched_groups"] for r in rows) == 0
    assert "generation engine: vllm" in (paths.logs / "generator-0.log").read_text()


@pytest.mark.slow
def test_tiny_ppo_run_learns_with_the_critic_in_its_own_process(tiny_ppo_baseline):
    """examples/tiny-ppo.yaml (12 steps): the critic runs as its own process, values and trains beside the trainer."""
    paths = RunPaths(tiny_ppo_baseline)
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, BASELINE_TRAINING["steps"] + 1))
    assert_reward_rose(rows, window=3)
    assert all(r["train_optim/critic_loss"] > 0 for r in rows)
    values = [r["train_rollouts/values"] for r in rows]
    assert values[0] == 0.0 and values[-1] > 0.05, "the critic's values (zero head at first) did not learn"
    assert all(0.5 < r["train_optim/ppo_ratio"] < 1.5 for r in rows)
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < 1e-4
    critic_log = (paths.logs / "critic.log").read_text()
    assert "restored step 0" in critic_log and "critic_checkpoints/step-000012" in critic_log
    assert (paths.critic_checkpoints / "step-000012").is_dir()


def test_bad_spec_names_the_field(tmp_path):
    path = write_spec(tmp_path, training={"lr": -1.0, "stepz": 3})
    result = reinforce("run", str(path), timeout=120)
    assert result.returncode == 2
    assert "training.lr" in result.stderr and "training.stepz" in result.stderr


def test_an_engine_that_is_not_installed_is_refused_before_anything_starts(tmp_path):
    # TensorRT-LLM cannot be installed on a machine without an NVIDIA GPU: the run says so and what to do.
    result = reinforce("run", str(write_spec(tmp_path, generation={"engine": "tensorrt_llm"})), timeout=120)
    assert result.returncode == 2
    assert "generation.engine tensorrt_llm needs the Python package 'tensorrt_llm'" in result.stderr
    assert "NVIDIA's index" in result.stderr
    assert not (tmp_path / "run").exists(), "the run folder was created before the engine was checked"


def test_bad_prompt_file_names_file_and_line(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    path = write_spec(tmp_path, data={"prompts": str(prompts)})
    result = reinforce("run", str(path), timeout=120)
    assert result.returncode == 2
    assert f"{prompts}:2" in result.stderr


@pytest.mark.slow
def test_asynchronous_run_keeps_lag_bounded_and_learns(tmp_path):
    result = reinforce("run", str(write_spec(tmp_path, algorithm={"max_policy_lag": 2})))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(RunPaths(tmp_path / "run").metrics)
    assert max(r["train_rollouts/policy_lag_max"] for r in rows) == 2  # generators ran ahead, never too far
    assert sum(r["train_rollouts/policy_lag"] for r in rows) > 0
    weights = [r["train_rollouts/importance_weight_mean"] for r in rows]
    assert all(0.5 < w < 1.5 for w in weights)
    assert_reward_rose(rows)


@pytest.mark.slow
def test_two_data_parallel_ranks_train_like_one(tmp_path, tiny_baseline):
    """torchrun, 2 gloo ranks, each on its own half of every step's groups: the same updates as one rank."""
    spec = write_spec(tmp_path, training={**BASELINE_TRAINING, "num_ranks": 2})
    result = reinforce("run", str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_weight_difference(tiny_baseline, tmp_path / "run") < 1e-5
    audit = [json.loads(line) for line in RunPaths(tmp_path / "run").trained_groups.read_text().splitlines()]
    assert all(sorted(r["prompt_ids"]) == sorted(f"{r['step'] - 1}-{i}" for i in range(8)) for r in audit)


@pytest.mark.slow
def test_megatron_tensor_parallel_run_trains_like_the_torch_backend(tiny_megatron_baseline, tiny_baseline):
    """backend megatron, tensor_parallel 2 over 2 torchrun ranks (one data-parallel rank: one reader, which shares
    its groups with its tensor peer): the same weights as the torch backend's single rank, each group trained once,
    the generator's log-probs its own. Measured 2e-6 after 12 steps (TP=2 against Megatron TP=1: 2e-6; Megatron TP=1
    against torch: 8e-7)."""
    assert max_weight_difference(tiny_baseline, tiny_megatron_baseline) < 1e-5
    paths = RunPaths(tiny_megatron_baseline)
    assert_each_step_trained_once(tiny_megatron_baseline, BASELINE_TRAINING["steps"])
    shards = sorted(p.name for p in (paths.checkpoints / "step-000012").glob("model-*"))
    assert shards == ["model-tp00-pp00.safetensors", "model-tp01-pp00.safetensors"]
    rows = read_metrics(paths.metrics)  # it learns as the torch backend does (test_tiny_run_learns): same weights
    assert max(r["train_rollouts/logprob_mismatch"] for r in rows) < 1e-4
    assert all(r["train_rollouts/policy_lag"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "training", "baseline", "tolerance"),
    [
        ("tiny", {"backend": "megatron", "num_ranks": 2}, "tiny_baseline", 1e-5),
        # 4 AdamW steps per step (2 epochs x 2 minibatches): float32 noise grows faster; measured 2e-5
        ("tiny-ppo", {"backend": "megatron"}, "tiny_ppo_baseline", 1e-4),
        # the main process alone is the critic's client; its tensor peer gets the values from it
        ("tiny-ppo", MEGATRON_TP2, "tiny_ppo_baseline", 1e-4),
    ],
    ids=["megatron-dp2", "megatron-ppo", "megatron-tp2-ppo"],
)
def test_megatron_layouts_train_like_the_torch_backend(tmp_path, request, example, training, baseline, tolerance):
    """Megatron over two data-parallel ranks (each reads its own half of a step's groups; gradients summed), and
    PPO on Megatron, also over two tensor-parallel ranks (the critic in its own process, as with torch): the torch
    backend's weights after 12 steps."""
    spec = write_spec(tmp_path, example, training={**BASELINE_TRAINING, **training})
    result = reinforce("run", str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_weight_difference(request.getfixturevalue(baseline), tmp_path / "run") < tolerance
    assert_each_step_trained_once(tmp_path / "run", BASELINE_TRAINING["steps"])


@pytest.mark.slow
def test_three_generators_relaying_weights_train_like_one(tmp_path, tiny_baseline):
    """weights.transport http with distribution relay: the trainer serves each version over HTTP, sends it once,
    and the generators pass it down a chain (generator/relay.py). Sampling depends only on (weights, prompt, seed),
    so three generators train like one; every generator loads every version a step was sampled with (the last one
    may arrive after the run ended), and the chain's last one gets each from a relay, never from the trainer."""
    weights = {"transport": "http", "distribution": "relay"}
    spec = write_spec(tmp_path, training=BASELINE_TRAINING, weights=weights, generation={"num_generators": 3})
    result = reinforce("run", str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    logs = RunPaths(tmp_path / "run").logs
    trainer_url = re.search(r"serving weights at (http://127.0.0.1:\S+)", (logs / "trainer.log").read_text()).group(1)
    sampled_with = list(range(1, BASELINE_TRAINING["steps"]))
    for name in ("generator-0", "generator-1", "generator-2"):
        loaded = re.findall(r"loaded weight version (\d+)", (logs / f"{name}.log").read_text())
        assert [int(v) for v in loaded][: len(sampled_with)] == sampled_with, name
    relayed = re.findall(r"weight version (\d+) relayed in \S+: (.*)", (logs / "generator-2.log").read_text())
    assert [int(v) for v, _ in relayed][: len(sampled_with)] == sampled_with
    assert all(trainer_url not in sources for _, sources in relayed), relayed
    assert max_weight_difference(tiny_baseline, tmp_path / "run") < 1e-5
