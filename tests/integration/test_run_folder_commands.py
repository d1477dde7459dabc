"""What did my model learn? The commands that answer from a run folder, on the tiny example through real processes.

One finished run (started with --run-dir) serves the samples, status, samples-command and generate tests; a second,
longer run is asked while it runs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from runs import FinishedRun, reinforce, start, wait_for_step, write_spec
from transformers import AutoModelForCausalLM

from reinforce.core.metrics import read_metrics, shown
from reinforce.core.policy import load_tokenizer
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import SAMPLE_KEYS, read_samples, sample_steps
from reinforce.core.spec import load_spec

STEPS = 30  # examples/tiny.yaml's


@pytest.fixture
def finished_run(tiny_run: FinishedRun) -> tuple[Path, FinishedRun]:
    """tests/conftest.py's tiny_run: examples/tiny.yaml run to its end in a folder named on the command line."""
    return tiny_run.run_dir, tiny_run


@pytest.mark.slow
def test_the_run_dir_option_wins_over_the_spec(finished_run):
    run_dir, result = finished_run
    assert f"run folder {run_dir};" in result.stdout
    assert not (run_dir.parent / "run").exists(), "the spec's run_dir was used"
    assert load_spec(RunPaths(run_dir).spec).run_dir == str(run_dir)  # what a --resume of it reads
    refused = reinforce("run", "--resume", str(run_dir), "--run-dir", str(run_dir.parent / "other"), timeout=60)
    assert refused.returncode == 2 and "--run-dir goes with a SPEC file" in refused.stderr


@pytest.mark.slow
def test_the_run_writes_samples_of_every_step_and_shows_the_first_and_last(finished_run):
    run_dir, result = finished_run
    paths = RunPaths(run_dir)
    assert sample_steps(paths) == list(range(1, STEPS + 1))
    for step in (1, STEPS):
        rows = read_samples(paths, step)
        assert [r["pick"] for r in rows] == ["best", "worst", "first", "first"]  # logging.num_samples: 4
        assert all(tuple(r) == SAMPLE_KEYS and r["step"] == step for r in rows)
        assert all(r["prompt_id"].startswith(f"{step - 1}-") for r in rows)  # the step's own prompts
        rewards = [r["reward"] for r in rows]
        assert rewards[0] == max(rewards) and rewards[1] == min(rewards)
        assert all(isinstance(r["advantage"], float) for r in rows)
        for r in rows:
            assert f"step {step} {r['pick']}:" in result.stdout or r["pick"] == "first"
            assert json.dumps(r["response"]) in result.stdout or r["pick"] == "first"
    # step 1 is sampled by weight version 0, the reference itself; training moves the policy away from it
    assert all(r["kl"] == 0.0 for r in read_samples(paths, 1))
    assert all(r["kl"] > 0.0 for r in read_samples(paths, STEPS))


@pytest.mark.slow
def test_samples_prints_the_last_step_or_the_one_asked(finished_run):
    run_dir, _ = finished_run
    last = reinforce("samples", str(run_dir), timeout=60)
    assert last.returncode == 0, last.stderr
    headers = [line for line in last.stdout.splitlines() if line.startswith("step ")]
    assert [h.split(":")[0] for h in headers] == [f"step {STEPS} {p}" for p in ("best", "worst", "first", "first")]
    first = reinforce("samples", str(run_dir), "--step", "1", timeout=60)
    assert json.dumps(read_samples(RunPaths(run_dir), 1)[0]["response"]) in first.stdout
    missing = reinforce("samples", str(run_dir), "--step", "99", timeout=60)
    assert missing.returncode == 2 and f"no samples of step 99; steps with samples: 1..{STEPS}" in missing.stderr


@pytest.mark.slow
def test_status_of_a_finished_run(finished_run, tmp_path):
    run_dir, _ = finished_run
    result = reinforce("status", str(run_dir), timeout=60)
    assert result.returncode == 0, result.stderr
    last = read_metrics(RunPaths(run_dir).metrics)[-1]
    lines = result.stdout.splitlines()
    assert lines[0] == "run tiny: finished"
    assert f"  step        {STEPS} / {STEPS}" in lines
    assert f"  reward      {shown(last['train_rollouts/rewards'], '.4f')} " in result.stdout
    assert f"  KL          {shown(last['train_rollouts/init_policy_kl'], '.4f')}" in lines
    assert f"  checkpoint  step-{STEPS:06d}" in lines
    assert "components" not in result.stdout  # nothing runs to be asked
    not_a_run = reinforce("status", str(tmp_path), timeout=60)
    assert not_a_run.returncode == 2 and "no spec.yaml, so not a run folder" in not_a_run.stderr


def _greedy(run_dir: Path, prompt: str, *args: str) -> str:
    result = reinforce("generate", str(run_dir), prompt, "--temperature", "0", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.removesuffix("\n")


@pytest.mark.slow
def test_generate_answers_with_the_final_model_or_a_checkpoint(finished_run):
    run_dir, _ = finished_run
    paths, prompt = RunPaths(run_dir), "say something kind"
    final, initial = _greedy(run_dir, prompt), _greedy(run_dir, prompt, "--checkpoint", "0")
    # the tiny example's reward is the fraction of "a": the trained model says more of it than the initial one
    assert final.count("a") > initial.count("a"), (final, initial)

    # the final model's answer is Hugging Face's greedy decoding of the run's encoding of the prompt
    tokenizer = load_tokenizer(paths.final_model)
    model = AutoModelForCausalLM.from_pretrained(paths.final_model)
    ids = encode_prompt(tokenizer, prompt, load_spec(paths.spec).data)
    max_new = load_spec(paths.spec).generation.max_new_tokens
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    assert final == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    # a checkpoint's weights (step 20: a torch checkpoint, its weight version no longer kept); fewer new tokens
    short = reinforce("generate", str(run_dir), prompt, "--checkpoint", "20", "--max-new-tokens", "3", timeout=120)
    assert short.returncode == 0 and "(3 tokens, " in short.stderr, short.stderr
    missing = reinforce("generate", str(run_dir), prompt, "--checkpoint", "5", timeout=120)
    assert missing.returncode == 2 and "no weights of step 5 (kept: step-000020, step-000030" in missing.stderr
    # the red team's R4-13: past generation.max_new_tokens's bound, and a temperature that is not a number
    huge = reinforce("generate", str(run_dir), prompt, "--max-new-tokens", "1000000000", timeout=120)
    assert huge.returncode == 2 and "--max-new-tokens 1000000000: Input should be less than or equal to" in huge.stderr
    nan = reinforce("generate", str(run_dir), prompt, "--temperature", "nan", timeout=120)
    assert nan.returncode == 2 and "--temperature must be a number" in nan.stderr, nan.stderr


@pytest.mark.slow
def test_status_of_a_live_run_asks_its_components_then_says_it_stopped(tmp_path):
    proc = start("run", str(write_spec(tmp_path, training={"steps": 1000, "checkpoint_every": 1000})))
    run_dir = tmp_path / "run"
    try:
        wait_for_step(proc, run_dir, 2)
        live = reinforce("status", str(run_dir), timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert live.returncode == 0, live.stderr
    lines = live.stdout.splitlines()
    assert lines[0] == f"run tiny: running (supervisor PID {proc.pid})"
    assert "  step        " in live.stdout and " / 1000" in live.stdout
    components = lines[lines.index("  components") + 1 :]
    assert [line.split()[:2] for line in components] == [
        ["redis", "up:"], ["reward", "up"], ["generator-0", "up:"], ["trainer", "up:"]
    ]  # fmt: skip
    assert "published weight version" in components[0] and "weight version" in components[2]
    assert "step" in components[3]

    stopped = reinforce("status", str(run_dir), timeout=60)
    assert stopped.stdout.splitlines()[0] == (
        f"run tiny: stopped (interrupted (Ctrl-C or SIGTERM); `reinforce run --resume {run_dir}` continues it)"
    )
