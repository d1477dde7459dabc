"""Micro-batches by prompt count against micro-batches by token budget, as responses grow to 512 tokens.

    python benchmarks/long_responses.py [--steps 4] [--spec examples/tiny.yaml]

The spec's policy, batch and training precision (examples/tiny.yaml: 8 prompts, k = 4, 32-token prompts, fp32;
examples/quickstart.yaml: SmolLM2-135M-Instruct, 64-token prompts, bf16); responses of mixed lengths, uniform
between 1 and max_new_tokens (32 or 512), random tokens (the speed and memory do not depend on them). Each
configuration trains REINFORCE steps on the same batch in this process, as the trainer runs them: the median seconds
per step (the first step, which allocates AdamW's state, left out) and the trainer's peak resident memory during a
step (train_memory/peak_rss_gib: VmHWM reset before each step), also above its resident memory before the step.
`count` is the old default (micro_batch_prompts 2, no token budget); `tokens` the new one (micro_batch_tokens 4096).
Writes the section "Long responses: micro-batches by count and by token budget" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
from sections import write_section

from reinforce.core.policy import materialize_policy
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import RunSpec, load_spec
from reinforce.trainer.algorithms import build_algorithm
from reinforce.trainer.backends import build_backend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.main import peak_rss_bytes, reset_peak_rss

REPO = Path(__file__).resolve().parent.parent
HEADING = "## Long responses: micro-batches by count and by token budget"
CONFIGS = {
    "count (micro_batch_prompts 2)": {"micro_batch_prompts": 2, "micro_batch_tokens": None},
    "tokens (micro_batch_tokens 4096)": {"micro_batch_prompts": None, "micro_batch_tokens": 4096},
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


def measure(spec: RunSpec, policy: Path, steps: int) -> dict[str, float]:
    backend = build_backend(spec.training, policy, Ranks())
    algorithm = build_algorithm(spec, Ranks())
    batch = mixed_batch(spec, vocab=backend.policy.config.vocab_size)
    seconds, peaks, above = [], [], []
    for step in range(steps + 1):
        before = psutil.Process().memory_info().rss
        reset_peak_rss()
        start = time.perf_counter()
        metrics = algorithm.update(batch, backend, version=step)
        seconds.append(time.perf_counter() - start)
        peaks.append(peak_rss_bytes() / 2**20)
        above.append(peaks[-1] - before / 2**20)
    return {
        "s_per_step": statistics.median(seconds[1:]),
        "peak_rss_mib": max(peaks[1:]),
        "above_mib": max(above[1:]),
        "micro_batches": metrics["train_batch/micro_batches"],
        "padding": metrics["train_batch/padding_fraction"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny.yaml", help="policy, batch, precision")
    args = parser.parse_args()
    base = load_spec(args.spec)
    rows = []
    spec_name = args.spec.resolve().relative_to(REPO) if args.spec.resolve().is_relative_to(REPO) else args.spec
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        policy = materialize_policy(base.policy, Path(tmp) / "policy", base.seed)
        for max_new_tokens in (32, 512):
            for name, training in CONFIGS.items():
                spec = base.model_copy(
                    update={
                        "generation": base.generation.model_copy(update={"max_new_tokens": max_new_tokens}),
                        "training": base.training.model_copy(update=training),
                    }
                )
                result = measure(spec, policy, args.steps)
                rows.append(
                    f"| {max_new_tokens} | {name} | {result['s_per_step']:.3f} | {result['peak_rss_mib']:.0f} | "
                    f"{result['above_mib']:.0f} | {result['micro_batches']:.0f} | {result['padding']:.0%} |"
                )
                print(rows[-1], flush=True)
    section = "\n".join(
        [
            HEADING,
            "",
            f"Generated by `python benchmarks/long_responses.py --steps {args.steps} --spec {spec_name}` "
            f"({torch.get_num_threads()} threads, 1-minute load average {load:.1f} at the start): {spec_name}'s "
            f"policy, {base.training.prompts_per_step} prompts x k = {base.algorithm.num_rollouts_per_prompt}, "
            f"{base.data.max_prompt_tokens}-token prompts, training.precision "
            f"{base.training.resolved_precision()}, responses uniform in [1, max_new_tokens]; REINFORCE steps in one "
            "process, median s/step after a warm-up step; peak RSS during a step, and above the RSS before it.",
            "",
            "| max_new_tokens | micro-batches | s/step | peak RSS MiB | above the step's start MiB | micro-batches "
            "per step | padding |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    write_section(section + "\n")


if __name__ == "__main__":
    main()
