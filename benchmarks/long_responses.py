"""Micro-batches by prompt count against micro-batches by token budget, as responses grow to 512 tokens.

    python benchmarks/long_responses.py [--steps 3] [--spec examples/tiny.yaml]
    python benchmarks/long_responses.py --render     (BENCHMARKS.md's section from the saved results only)

The spec's policy, batch and training precision (examples/tiny.yaml: 8 prompts, k = 4, 32-token prompts, fp32;
examples/quickstart.yaml: SmolLM2-135M-Instruct, 64-token prompts, bf16); responses of mixed lengths, uniform
between 1 and max_new_tokens (32 or 512), random tokens (the speed and memory do not depend on them). Each
configuration runs in a fresh process, as a trainer would: it loads the policy and the reference and trains
REINFORCE steps on the same batch. Printed and saved (benchmarks/results/long_responses.json, then BENCHMARKS.md):
the median seconds per step (the first step, which allocates AdamW's state, left out), the process's peak resident
memory over its whole life (VmHWM: what a pod's memory limit meets), and that peak above the resident memory once
the models were loaded. `count` is the old default (micro_batch_prompts 2, no token budget); `tokens 4096` the
budget before it was lowered; then the defaults (training.micro_batch_tokens, training.allocator system), the same
budget with training.allocator jemalloc, and with training.gradient_checkpointing on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil
import torch
from sections import write_section

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.policy import materialize_policy
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import RunSpec, TrainingSpec, load_spec
from reinforce.trainer.algorithms import build_algorithm
from reinforce.trainer.allocator import use_allocator
from reinforce.trainer.backends import build_backend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.main import peak_rss_bytes

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "long_responses.json"
HEADING = "## Long responses: micro-batches by count and by token budget"
RESPONSE_LENGTHS = (32, 512)
DEFAULTS = TrainingSpec()
TOKENS = {"micro_batch_prompts": None, "micro_batch_tokens": DEFAULTS.micro_batch_tokens}
CONFIGS = {
    "count (micro_batch_prompts 2), malloc": {
        "micro_batch_prompts": 2,
        "micro_batch_tokens": None,
        "allocator": "system",
    },
    "tokens 4096, malloc": {**TOKENS, "micro_batch_tokens": 4096, "allocator": "system"},
    f"tokens {DEFAULTS.micro_batch_tokens}, malloc (the defaults)": {**TOKENS, "allocator": DEFAULTS.allocator},
    f"tokens {DEFAULTS.micro_batch_tokens}, jemalloc": {**TOKENS, "allocator": "jemalloc"},
    f"tokens {DEFAULTS.micro_batch_tokens} + gradient checkpointing, malloc": {
        **TOKENS,
        "gradient_checkpointing": True,
        "allocator": "system",
    },
}


def mixed_batch(spec: RunSpec, vocab: int) -> StepBatch:
    g = torch.Generator().manual_seed(0)
    k, groups = spec.algorithm.num_rollouts_per_prompt, []
    for i in range(spec.training.prompts_per_step):
        lengths = torch.randint(1, spec.generation.max_new_tokens + 1, (k,), generator=g).tolist()
        samples = [
            Sample(token_ids=torch.randint(3, vocab, (n,), generator=g).tolist(), logprobs=[0.0] * n, reward=float(j),
                   is_end=True)
            for j, n in enumerate(lengths)
        ]  # fmt: skip
        prompt = torch.randint(3, vocab, (spec.data.max_prompt_tokens,), generator=g).tolist()
        groups.append(RolloutGroup(prompt_id=f"0-{i}", prompt_token_ids=prompt, samples=samples))
    return StepBatch.from_groups(groups)


def configured(base: RunSpec, max_new_tokens: int, config: str) -> RunSpec:
    return base.model_copy(
        update={
            "generation": base.generation.model_copy(update={"max_new_tokens": max_new_tokens}),
            "training": base.training.model_copy(update=CONFIGS[config]),
        }
    )


def measure(spec: RunSpec, policy: Path, steps: int) -> dict[str, float]:
    """In this (fresh) process: load, then train `steps` + 1 steps on one batch."""
    backend = build_backend(spec.training, policy, Ranks())
    algorithm = build_algorithm(spec, Ranks())
    batch = mixed_batch(spec, vocab=backend.policy.config.vocab_size)
    loaded = psutil.Process().memory_info().rss
    seconds = []
    for step in range(steps + 1):
        start = time.perf_counter()
        metrics = algorithm.update(batch, backend, version=step)
        seconds.append(time.perf_counter() - start)
    return {
        "s_per_step": statistics.median(seconds[1:]),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "above_loaded_mib": (peak_rss_bytes() - loaded) / 2**20,
        "micro_batches": metrics["train_batch/micro_batches"],
        "padding": metrics["train_batch/padding_fraction"],
    }


def measure_in_fresh_process(spec_path: Path, policy: Path, max_new_tokens: int, config: str, steps: int) -> dict:
    command = [sys.executable, __file__, "--one", str(max_new_tokens), config, "--spec", str(spec_path)]
    command += ["--policy", str(policy), "--steps", str(steps)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def render(results: dict) -> str:
    s = results["settings"]
    lines = [
        HEADING,
        "",
        f"Written by `python benchmarks/long_responses.py --steps {s['steps']} --spec {s['spec']}` from "
        f"`benchmarks/results/long_responses.json` ({results['machine']}, {results['threads']} threads, 1-minute load "
        f"average {results['load']:.1f} at the start; measured {results['date']}): {s['spec']}'s policy, "
        f"{s['prompts']} prompts x k = {s['k']}, {s['prompt_tokens']}-token prompts, training.precision "
        f"{s['precision']}, responses uniform in [1, max_new_tokens]. Each row is a fresh process that loads the "
        "policy and the reference and trains REINFORCE steps on one batch: median s/step after a warm-up step; the "
        "process's peak RSS over its life (what a pod's memory limit meets), its ratio to the same configuration's "
        "at 32 tokens, and the peak above the RSS once the models were loaded. malloc and jemalloc: "
        "training.allocator system (the default) and jemalloc.",
        "",
        "| max_new_tokens | micro-batches | s/step | peak RSS MiB | peak / at 32 tokens | above loaded MiB "
        "| micro-batches per step | padding |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    first = {r["config"]: r["peak_rss_mib"] for r in results["rows"] if r["max_new_tokens"] == RESPONSE_LENGTHS[0]}
    for r in results["rows"]:
        lines.append(
            f"| {r['max_new_tokens']} | {r['config']} | {r['s_per_step']:.3f} | {r['peak_rss_mib']:.0f} | "
            f"{r['peak_rss_mib'] / first[r['config']]:.2f}x | {r['above_loaded_mib']:.0f} | "
            f"{r['micro_batches']:.0f} | {r['padding']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny.yaml", help="policy, batch, precision")
    parser.add_argument("--render", action="store_true", help="write BENCHMARKS.md from the saved results only")
    parser.add_argument("--one", nargs=2, metavar=("MAX_NEW_TOKENS", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        write_section(render(json.loads(RESULTS.read_text())))
        return
    base = load_spec(args.spec)
    if args.one:
        spec = configured(base, int(args.one[0]), args.one[1])
        use_allocator(spec.training.allocator)  # as the trainer does: this process may start again
        print(json.dumps(measure(spec, args.policy, args.steps)))
        return
    spec_path = args.spec.resolve()
    spec_name = spec_path.relative_to(REPO) if spec_path.is_relative_to(REPO) else spec_path
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = materialize_policy(base.policy, Path(tmp) / "policy", base.seed)
        for max_new_tokens in RESPONSE_LENGTHS:
            for config in CONFIGS:
                result = measure_in_fresh_process(spec_path, policy, max_new_tokens, config, args.steps)
                rows.append({"max_new_tokens": max_new_tokens, "config": config, **result})
                print(rows[-1], flush=True)
    results = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "threads": torch.get_num_threads(),
        "load": load,
        "settings": {
            "steps": args.steps,
            "spec": str(spec_name),
            "prompts": base.training.prompts_per_step,
            "k": base.algorithm.num_rollouts_per_prompt,
            "prompt_tokens": base.data.max_prompt_tokens,
            "precision": base.training.resolved_precision(bfloat16_is_native("cpu")),
        },
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_section(render(results))


if __name__ == "__main__":
    main()
