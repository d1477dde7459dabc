"""`reinforce generate RUN_DIR PROMPT [--checkpoint STEP]`: the run's model answers a prompt.

The prompt is encoded as the run's generators encode theirs (data.chat_template, system_prompt, max_prompt_tokens)
and sampled by the torch engine with the run's generation settings (temperature, top_k, top_p, stop strings,
max_new_tokens), whatever engine the run used. The model: the final one (RUN_DIR/final_model), or with
--checkpoint STEP the weights after STEP steps (0: the initial policy): the published weight version STEP while
RUN_DIR/weights keeps it, else the torch backend's checkpoint of that step.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pydantic import ValidationError
from transformers.utils import logging as transformers_logging

from reinforce.core.environment_api import prompt_data
from reinforce.core.prompt_encoding import encode_prompt
from reinforce.core.run_dir import RunPaths
from reinforce.core.spec import GenerationSpec, RunSpec, SpecError, load_spec
from reinforce.core.weights import weight_path
from reinforce.generator.engines.base import SampledSequence
from reinforce.generator.engines.torch_engine import TorchEngine


def weights_of_step(paths: RunPaths, spec: RunSpec, step: int) -> Path:
    """The policy's weights after `step` steps, in a file TorchEngine.load_weights reads."""
    published = weight_path(paths.weights, step)
    if published.exists():
        return published
    checkpoint = paths.checkpoints / f"step-{step:06d}" / "model.safetensors"
    # the torch backend's checkpoint holds the whole policy under Hugging Face names (not so with LoRA or Megatron)
    if checkpoint.exists() and spec.training.backend == "torch" and spec.training.lora is None:
        return checkpoint
    kept = sorted({p.name for p in paths.checkpoints.glob("step-*")} | {p.name for p in paths.weights.glob("v*")})
    raise SpecError(f"{paths.root}: no weights of step {step} (kept: {', '.join(kept) or 'none'})")


def answer(
    paths: RunPaths, prompt: str, step: int | None, max_new_tokens: int | None, temperature: float | None, seed: int
) -> SampledSequence:
    if not paths.spec.exists():
        raise SpecError(f"{paths.root}: no spec.yaml, so not a run folder (`reinforce run` writes it)")
    spec = load_spec(paths.spec)
    generation = spec.generation
    if max_new_tokens is not None:
        try:  # within generation.max_new_tokens's own bounds
            generation = GenerationSpec.model_validate({**generation.model_dump(), "max_new_tokens": max_new_tokens})
        except ValidationError as err:
            raise SpecError(f"--max-new-tokens {max_new_tokens}: {err.errors()[0]['msg']}") from None
    if step is None:
        if not paths.final_model.exists():
            raise SpecError(f"{paths.final_model}: no final model yet (the run has not finished); pass --checkpoint")
        engine = TorchEngine(paths.final_model, generation, num_samples=1)
    else:
        engine = TorchEngine(paths.initial_policy, generation, num_samples=1)  # weight version 0
        if step > 0:
            engine.load_weights(weights_of_step(paths, spec, step))
    ids = encode_prompt(engine.tokenizer, prompt, prompt_data(spec))  # as the run's training prompts were
    if ids is None:
        raise SpecError(f"the prompt is longer than data.max_prompt_tokens ({spec.data.max_prompt_tokens} tokens)")
    [[response]] = engine.sample([ids], [seed], num_samples=1, temperature=temperature)
    return response


def generate_command(args: argparse.Namespace) -> int:
    transformers_logging.disable_progress_bar()  # stdout and stderr carry the answer and its length only
    paths = RunPaths(Path(args.run_dir))
    response = answer(paths, args.prompt, args.checkpoint, args.max_new_tokens, args.temperature, args.seed)
    print(response.text)
    ended = "ended" if response.is_end else "cut at max_new_tokens"
    print(f"({len(response.token_ids)} tokens, {ended})", file=sys.stderr)
    return 0


def add_generate_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="the run's final model (or a checkpoint's) answers a prompt")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    parser.add_argument("prompt", help="the prompt, as a training prompt is given (chat-templated if the run's are)")
    parser.add_argument(
        "--checkpoint", type=int, metavar="STEP", help="the weights after STEP steps (0: the initial policy)"
    )
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="default: the run's generation.max_new_tokens")
    parser.add_argument("--temperature", type=float, help="default: the run's generation.temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.set_defaults(handler=generate_command, check=_check_generate_arguments)


def _check_generate_arguments(args: argparse.Namespace) -> str | None:
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return "--max-new-tokens must be at least 1"
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature must be a number, 0 (greedy) or more, not {args.temperature}"
    return None
