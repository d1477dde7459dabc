"""LoRA on vLLM: bytes and refit time per weight version, adapter-only against full weights, on SmolLM2-135M-Instruct.

    python benchmarks/lora_vllm.py [--versions 5] [--threads 2] [--work DIR] [--render]

Cases, each served by a vLLM engine (bfloat16, its default on bfloat16 hardware) built as a generator builds it
(`build_engine`):

- full: no LoRA. The trainer's torch backend publishes the whole policy in bfloat16 (the engine's dtype, as
  trainer/main.py does) and the engine reloads it in place;
- lora r=R MODULES: training.lora with that rank and target modules. The backend publishes only its adapters
  (float32, as trained) and the engine loads each version as a new vLLM LoRA adapter, removing the previous one.

Per case, over --versions weight versions (the trainable weights moved between versions, as an optimiser step
would): bytes, the published file's size on disk; publish s, `weights.publish` (write and sha256) of the backend's
`weights_to_publish`, median; refit s, `engine.load_weights` of the file, median and max; tok/s, sampling the
quickstart case of benchmarks/engines.py (8 prompts x k=4, 48 new tokens, temperature 1), one call after a warm-up,
at version 0 (for lora: LoRA on, no adapter yet) and after the last refit (an adapter adds compute beside each
adapted layer). Every number is measured in one process (vLLM keeps process-wide state, so every engine stays alive
to the end). Writes benchmarks/results/lora_vllm.json and the section "LoRA on vLLM" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
from engines import CASES, POLICY, PROMPTS
from sections import write_section

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.policy import load_tokenizer, materialize_policy
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.spec import DataSpec, GenerationSpec, LoraSpec, TrainingSpec
from reinforce.core.weights import publish
from reinforce.generator.engines import build_engine
from reinforce.generator.engines.base import GenerationEngine
from reinforce.trainer.backends.torch_backend import TorchBackend
from reinforce.trainer.distributed import Ranks

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "lora_vllm.json"
HEADING = "## LoRA on vLLM: bytes and refit time per weight version"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # training.lora.target_modules' default
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
LORA_CASES = {"lora r=8 attention": LoraSpec(rank=8, target_modules=ATTENTION),
              "lora r=16 all linear": LoraSpec(rank=16, alpha=32.0, target_modules=ALL_LINEAR)}  # fmt: skip
QUICKSTART = CASES[0]


def quickstart_prompts(policy: Path) -> list[list[int]]:
    """The quickstart's reviews, chat-templated as its generators encode them (engines.py's prompts)."""
    tokenizer = load_tokenizer(policy)
    data = DataSpec(prompts=str(PROMPTS), max_prompt_tokens=64)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    return [ids for text in texts[: QUICKSTART.prompts] if (ids := encode_prompt(tokenizer, text, data))]


def move(backend: TorchBackend, seed: int) -> None:
    """A stand-in for an optimiser step: every trainable weight moves a little."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in backend.trainable_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


def measure(name: str, lora: LoraSpec | None, policy: Path, work: Path, versions: int, engines: list) -> dict:
    load_before = os.getloadavg()[0]
    backend = TorchBackend(TrainingSpec(lora=lora), policy, Ranks())
    new_tokens = QUICKSTART.generation.max_new_tokens
    generation = GenerationSpec(engine="vllm", dtype="bfloat16", max_new_tokens=new_tokens, temperature=1.0)
    engine = build_engine(generation, policy, QUICKSTART.k, lora)
    engines.append(engine)  # kept alive: releasing a vLLM engine tears down state the others use
    engine_dtype = getattr(torch, generation.resolved_dtype(bfloat16_is_native()))
    dtype = None if lora is not None else engine_dtype  # as trainer/main.py
    prompts = quickstart_prompts(policy)
    seeds = [1000 + i for i in range(len(prompts))]
    engine.sample(prompts[:2], seeds[:2])  # warm-up
    version_0_tok_s = tokens_per_second(engine, prompts, seeds)  # no adapter yet: what enable_lora alone costs
    sizes, publish_s, refit_s = [], [], []
    for version in range(1, versions + 1):
        move(backend, version)
        start = time.perf_counter()
        tensors, metadata = backend.weights_to_publish()
        record = publish(tensors, work / name.replace(" ", "-"), version, metadata=metadata, dtype=dtype)
        publish_s.append(time.perf_counter() - start)
        path = Path(record.uri)
        sizes.append(path.stat().st_size)
        start = time.perf_counter()
        engine.load_weights(path)
        refit_s.append(time.perf_counter() - start)
    return {
        "case": name,
        "bytes": statistics.median(sizes),
        "publish_s": statistics.median(publish_s),
        "refit_s": statistics.median(refit_s),
        "refit_max_s": max(refit_s),
        "tok_s_version_0": version_0_tok_s,
        "tok_s": tokens_per_second(engine, prompts, seeds),
        "versions": versions,
        # the 1-minute load average before and after: timings on a shared machine mean little without it
        "load_avg": [load_before, os.getloadavg()[0]],
    }


def tokens_per_second(engine: GenerationEngine, prompts: list[list[int]], seeds: list[int]) -> float:
    start = time.perf_counter()
    sampled = engine.sample(prompts, seeds)
    return sum(len(s.token_ids) for group in sampled for s in group) / (time.perf_counter() - start)


def render(results: dict) -> str:
    full = next(r for r in results["runs"] if r["case"] == "full")
    lines = [
        HEADING,
        "",
        "Generated by `python benchmarks/lora_vllm.py` from `benchmarks/results/lora_vllm.json`: SmolLM2-135M-Instruct "
        f"on the vLLM engine (bfloat16, {results['threads']} threads), {full['versions']} weight versions per case. "
        "full: the whole policy published in bfloat16 and reloaded in place; lora: only the adapters published "
        "(float32, as trained) and loaded as a vLLM LoRA adapter (the previous one removed). Bytes: the published "
        "file on disk. Publish: `weights.publish` (write and sha256), median. Refit: the engine's `load_weights`, "
        "median (max). tok/s: the quickstart's sampling (8 prompts x k=4, 48 new tokens) at version 0 (lora: the "
        "engine with LoRA on and no adapter yet) and after the last refit; one call each, after a warm-up. "
        f"{results['machine']}, {results['date']}.",
        "",
        "| case | bytes per version | vs full | publish s | refit s (max) | tok/s v0 / last | "
        "load avg before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['case']} | {r['bytes'] / 1e6:.2f} MB | {r['bytes'] / full['bytes']:.2%} | {r['publish_s']:.3f} | "
            f"{r['refit_s']:.3f} ({r['refit_max_s']:.3f}) | {_rates(r)} | {_load(r)} |"
        )
    lines += [
        "",
        "On CPU an adapter costs sampling speed (tok/s after the last refit against version 0 of the same engine): "
        "vLLM 0.32's CPU LoRA ops (`vllm/lora/ops/torch_ops/lora_ops.py`) gather a copy of the adapter's weights for "
        "every token and multiply with einsum; on GPU vLLM runs its Triton LoRA kernels instead (not measured here). "
        "tok/s also moves with the shared machine's load (last column): compare rows for bytes and refit time, and "
        "a row's two rates with each other.",
    ]
    return "\n".join(lines) + "\n"


def _rates(run: dict) -> str:
    first = f"{run['tok_s_version_0']:.0f}" if "tok_s_version_0" in run else "-"
    return f"{first} / {run['tok_s']:.0f}"


def _load(run: dict) -> str:
    return " / ".join(f"{x:.1f}" for x in run["load_avg"]) if "load_avg" in run else "not recorded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/benchmark-lora-vllm"))
    parser.add_argument("--render", action="store_true", help="only re-render BENCHMARKS.md from the saved JSON")
    args = parser.parse_args()
    if not args.render:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by vLLM at start
        policy = materialize_policy(POLICY, args.work / "policy", seed=0)
        engines: list = []
        runs = [measure("full", None, policy, args.work, args.versions, engines)]
        print(json.dumps(runs[-1]), flush=True)
        for name, lora in LORA_CASES.items():
            runs.append(measure(name, lora, policy, args.work, args.versions, engines))
            print(json.dumps(runs[-1]), flush=True)
        results = {
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs",
            "date": date.today().isoformat(),
            "threads": args.threads,
            "runs": runs,
        }
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_section(render(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
