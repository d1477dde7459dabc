"""The arithmetic example's held-out accuracy before and after training: greedy and sampled.

    python benchmarks/arithmetic.py RUN_DIR [--samples 8]

RUN_DIR is a finished run of examples/arithmetic.yaml. On its validation prompts (operand pairs it never trained on)
the initial policy and the final model each answer greedily once and at temperature 1 `--samples` times per prompt,
with the torch engine and the run's prompt encoding and max_new_tokens; an answer is right when math_answer says so
(the last number equals the record's answer). Prints the table, saves benchmarks/results/arithmetic.json and writes
the "Arithmetic example" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sections import save_and_write

from reinforce.core.data import prompt_answer, read_prompt_file
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import load_spec
from reinforce.generator.engines.torch_engine import TorchEngine
from reinforce.reward.rewards import math_answer

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "arithmetic.json"
HEADING = "## Arithmetic example"


def accuracy(engine: TorchEngine, prompts: list[str], ids: list[list[int]], samples: int) -> dict[str, float]:
    """Greedy and sampled (temperature 1) accuracy: the fraction of answers math_answer scores 1."""
    seeds = list(range(len(prompts)))
    out = {}
    for name, k, temperature in (("greedy", 1, 0.0), ("sampled", samples, 1.0)):
        groups = engine.sample(ids, seeds, num_samples=k, temperature=temperature)
        texts = [s.text for group in groups for s in group]
        answers = [prompt_answer(p) for p in prompts for _ in range(k)]
        out[name] = sum(math_answer([""] * len(texts), texts, answers)) / len(texts)
    return out


def render(results: dict) -> str:
    lines = [
        HEADING,
        "",
        f"Written by `python benchmarks/arithmetic.py RUN_DIR` after `reinforce run examples/arithmetic.yaml` "
        f"({results['steps']} steps). Held-out operand pairs ({results['prompts']} prompts, none trained on), answers "
        f"scored by `math_answer`; sampled: {results['samples']} answers per prompt at temperature 1. Measured "
        f"{results['date']}.",
        "",
        "| model | greedy accuracy | sampled accuracy |",
        "| --- | --- | --- |",
    ]
    for name in ("initial", "final"):
        r = results[name]
        lines.append(f"| {name} | {r['greedy']:.0%} | {r['sampled']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per prompt")
    args = parser.parse_args()
    paths = RunPaths(args.run_dir)
    spec = load_spec(paths.spec)
    prompts = read_prompt_file(spec.data.validation_prompts).prompts
    results: dict = {"samples": args.samples, "prompts": len(prompts), "steps": spec.training.steps}
    for name, folder in (("initial", paths.initial_policy), ("final", paths.final_model)):
        engine = TorchEngine(folder, spec.generation, num_samples=1)
        ids = [encode_prompt(engine.tokenizer, p, spec.data) for p in prompts]
        results[name] = accuracy(engine, prompts, ids, args.samples)
        print(name, results[name])
    results["date"] = time.strftime("%Y-%m-%d")
    save_and_write(RESULTS, results, render)


if __name__ == "__main__":
    main()
