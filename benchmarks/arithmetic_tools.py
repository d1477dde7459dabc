"""The tool example's held-out accuracy and tool calls per episode before and after training.

    python benchmarks/arithmetic_tools.py RUN_DIR [--samples 4]

RUN_DIR is a finished run of examples/arithmetic-tools.yaml. On its validation prompts (operand pairs it never
trained on) the initial policy and the final model each run episodes through the real environment service
(`python -m reinforce.environment` with the run's spec, its sandboxed python tool) and the generator's own episode
loop (generator/episodes.py) with the run's engine (generation.engine and dtype): greedily once and `--samples`
times per prompt at the run's generation.temperature, with the run's prompt encoding (the tools' instructions in the
system message) and max_new_tokens. An episode is right when math_answer says so of its whole text, the tool's
output included, as the run's reward scores it. Prints the table, saves benchmarks/results/arithmetic_tools.json
and writes the "Arithmetic with the python tool" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx
from environment import TOKEN, start_environment
from sections import write_section
from transformers import AutoConfig

from reinforce.core.data import prompt_answer, read_prompt_file
from reinforce.core.environment_api import prompt_data
from reinforce.core.policy import load_tokenizer
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import RunSpec, load_spec
from reinforce.generator.engines import build_engine
from reinforce.generator.engines.common import eos_token_ids
from reinforce.generator.episodes import Episode, EpisodeRunner, ObservationFormat
from reinforce.reward.rewards import math_answer

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "arithmetic_tools.json"
HEADING = "## Arithmetic with the python tool"


def episode_runner(folder: Path, spec: RunSpec, url: str) -> EpisodeRunner:
    """The generator's episode loop (as generator/worker.py builds it) around the run's engine, loading `folder`."""
    engine = build_engine(spec.generation, folder, num_samples=1)
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(folder, AutoConfig.from_pretrained(folder, local_files_only=True), tokenizer)
    return EpisodeRunner(engine, ObservationFormat(tokenizer, spec.data.chat_template, eos), url, TOKEN, "benchmark")


def score(runner: EpisodeRunner, prompts: list[str], groups: list[list[Episode]]) -> dict[str, float]:
    """Accuracy (math_answer on each episode's whole text), tool calls per episode, the shares of episodes with a
    tool call and of episodes that ended within max_new_tokens."""
    episodes = [e for group in groups for e in group]
    k = len(groups[0])
    tokenizer = runner.observations.tokenizer
    texts = [tokenizer.decode(e.token_ids, skip_special_tokens=True) for e in episodes]
    answers = [prompt_answer(p) for p in prompts for _ in range(k)]
    right = math_answer([""] * len(texts), texts, answers)
    return {
        "accuracy": sum(right) / len(texts),
        "tool_calls": sum(e.tool_calls for e in episodes) / len(episodes),
        "calling": sum(e.tool_calls > 0 for e in episodes) / len(episodes),
        "ended": sum(e.is_end for e in episodes) / len(episodes),
        "example": texts[0],
    }


def evaluate(folder: Path, spec: RunSpec, prompts: list[str], url: str, samples: int) -> dict[str, dict]:
    """Greedy (one episode per prompt) and sampled (`samples` per prompt, the run's temperature) scores of one
    model."""
    runner = episode_runner(folder, spec, url)
    data = prompt_data(spec)
    batch = [(encode_prompt(runner.observations.tokenizer, p, data), p, i) for i, p in enumerate(prompts)]
    out = {}
    size = spec.generation.batch_prompts  # as the generator batches: the whole set at once, on a loaded machine,
    # left episodes idle past environment.episode_idle_s while the engine sampled the others' first turns
    for name, k, temperature in (("greedy", 1, 0.0), ("sampled", samples, spec.generation.temperature)):
        groups = [g for i in range(0, len(batch), size) for g in runner.run(batch[i : i + size], k, temperature)]
        out[name] = score(runner, prompts, groups)
        print(name, json.dumps(out[name]), flush=True)
    return out


def render(results: dict) -> str:
    r = results
    lines = [
        HEADING,
        "",
        f"Written by `python benchmarks/arithmetic_tools.py RUN_DIR` after `reinforce run "
        f"examples/arithmetic-tools.yaml` ({r['steps']} steps, {r['train_minutes']:.0f} minutes). Held-out "
        f"3-digit by 3-digit products ({r['prompts']} prompts, none trained on), episodes of at most "
        f"{r['max_turns']} turns through the real environment service (python tool, sandbox isolation "
        f"{r['isolation']}), scored by `math_answer` on the whole episode; greedy: one episode per prompt; "
        f"sampled: {r['samples']} per prompt at the run's temperature, {r['temperature']:g}. Tool calls: per "
        f"episode (mean); calling: the share of episodes with at least one; ended: the share that ended within "
        f"max_new_tokens ({r['max_new_tokens']} tokens, the tool's output included; an episode cut there is still "
        f"scored, as the run's reward scores it). Machine: {r['cpus']} CPUs shared with other work (1-minute load "
        f"average up to {r['load_average']:.1f} when the measurements started). Measured {r['date']}.",
        "",
        "The prompts ask for Python code (`Write Python code to compute A * B, then give the number.`): asked "
        "`What is A * B? Answer with the number only.`, with the same tool instructions in the system message, the "
        "initial policy called the tool in none of 160 episodes (32 prompts, greedy and 4 sampled at temperature 1, "
        "96 tokens), so RL had nothing to reinforce. Asked for code it writes ```` ```python ```` blocks; no "
        "episode here held `<tool_call>` JSON. An assistant turn ends where its first python block closes "
        "(generator/episodes.py): before that, the model wrote on after its code, inventing the output, until "
        "max_new_tokens, the tool ran late or not at all, and 20 steps took greedy accuracy from 59% to 0%. The run "
        "samples at temperature 0.3: at 0.7 none of its first 64 training episodes was right (GRPO had nothing to "
        "reinforce).",
        "",
        "| model | greedy accuracy | greedy tool calls | greedy ended | sampled accuracy | sampled tool calls "
        "| sampled calling | sampled ended |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("initial", "final"):
        g, s = r[name]["greedy"], r[name]["sampled"]
        lines.append(
            f"| {name} | {g['accuracy']:.0%} | {g['tool_calls']:.2f} | {g['ended']:.0%} | {s['accuracy']:.0%} "
            f"| {s['tool_calls']:.2f} | {s['calling']:.0%} | {s['ended']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--samples", type=int, default=4, help="sampled episodes per prompt")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["initial", "final"],
        choices=["initial", "final"],
        help="evaluate these; the other's scores are kept from the saved results (the initial policy can be "
        "measured while the run trains)",
    )
    parser.add_argument("--train-minutes", type=float, default=0.0, help="the run's wall-clock, for the table")
    args = parser.parse_args()
    paths = RunPaths(args.run_dir)
    spec = load_spec(paths.spec)
    prompts = read_prompt_file(spec.data.validation_prompts).prompts
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() and args.models != ["initial", "final"] else {}
    results: dict = {
        **saved,
        "samples": args.samples,
        "temperature": spec.generation.temperature,
        "prompts": len(prompts),
        "steps": spec.training.steps,
        "max_turns": spec.environment.max_turns,
        "max_new_tokens": spec.generation.max_new_tokens,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    results["train_minutes"] = args.train_minutes or saved.get("train_minutes", 0.0)
    results["load_average"] = max(os.getloadavg()[0], saved.get("load_average", 0.0))
    process, url = start_environment(paths.spec, args.run_dir / "benchmark-environment.log")
    try:
        results["isolation"] = httpx.get(url + "/readyz").json()["isolation"]
        folders = {"initial": paths.initial_policy, "final": paths.final_model}
        for name in args.models:
            results[name] = evaluate(folders[name], spec, prompts, url, args.samples)
    finally:
        process.terminate()
        process.wait()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    if "initial" in results and "final" in results:
        section = render(results)
        write_section(section)
        print(section)


if __name__ == "__main__":
    main()
