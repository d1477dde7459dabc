"""Reward implementations behind one signature, built from a `RewardSpec`.

A reward function maps (prompts, responses) to one float per response; a user function that takes a parameter
`answers` also gets each prompt's reference answer (the prompt record's `answer` field, "" where it had none). The
reward server wraps whatever `build_reward_fn` returns; the same function can be called in-process (tests,
evaluation). A multi-turn episode's response is its whole trajectory, the tools' output included.

NaN and inf are legal results here: they are passed through unchanged and the trainer decides what to do
with them. What is not legal is a result of the wrong length or a non-numeric value: that is an error
naming the function, raised before anything reaches the wire.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from reinforce.core.environment_client import EnvironmentClient
from reinforce.core.spec import CODE_TESTS_REWARD, RewardSpec


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]: ...


class RewardError(ValueError):
    """A reward function that cannot be built, or that returned something other than one float per row."""


# ---------------------------------------------------------------------------------------------------------
# Built-in python rewards, usable as `function: reinforce.reward.rewards:NAME`.


def char_fraction(prompts: list[str], responses: list[str], char: str = "a") -> list[float]:
    """Fraction of each response's characters equal to `char` (0 for an empty response).

    Trivially learnable by a tiny random policy, which makes it the reward of the tiny example: the
    learning curve moves within a few steps on CPU.
    """
    if len(char) != 1:
        raise ValueError(f"char_fraction: char must be one character, got {char!r}")
    return [r.count(char) / len(r) if r else 0.0 for r in responses]


# Math answers: a \boxed{...} answer (the last one), else the last number of the response.
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
# thousands separated by commas or not, decimals; a sentence's full stop or comma after it is not part of it
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def final_answer(response: str) -> str | None:
    """The response's answer: the content of its last \\boxed{...}, else its last number; None without either."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1].strip()
    numbers_found = _NUMBER.findall(response)
    return numbers_found[-1] if numbers_found else None


def _as_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").replace(" ", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(found: str, reference: str) -> bool:
    """Equal as numbers (1,000 = 1000.0; tolerance 1e-6 relative) when both are numbers, else as stripped text."""
    a, b = _as_number(found), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return found.strip() == reference.strip()


def math_answer(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """1.0 where the response's final answer (`final_answer`) equals the prompt's reference answer (`same_answer`),
    else 0.0; a prompt without a reference answer is an error (the data file lacks its `answer` field)."""
    missing = [i for i, a in enumerate(answers) if not a.strip()]
    if missing:
        raise ValueError(f"math_answer: {len(missing)} prompts without a reference answer (their record's `answer`)")
    found = [final_answer(r) for r in responses]
    return [float(f is not None and same_answer(f, a)) for f, a in zip(found, answers, strict=True)]


# Code: the response's last ```python block, judged against the prompt's tests in the environment service's sandbox by
# judge.py, whose source is the program: the solution runs in a process of its own, the tests in the judge's.
_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
JUDGE_SOURCE = (Path(__file__).parent / "judge.py").read_text()
# One request's wait: for a free call slot (environment.max_concurrent_calls), then for the program's time limit.
CODE_TESTS_TIMEOUT_S = 600.0


def final_code(response: str) -> str | None:
    """The content of the response's last fenced ```python (or ```py) block; None without one."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


def checking_program(solution: str, tests: str) -> str:
    """A program that exits with 0 exactly when `tests` (asserts) ran to their end against `solution` (judge.py)."""
    return f"{JUDGE_SOURCE}\njudge({solution!r}, {tests!r}, {JUDGE_SOURCE!r})\n"


def code_tests(
    prompts: list[str], responses: list[str], answers: list[str], environment_url: str, environment_token: str
) -> list[float]:
    """1.0 where the response's last ```python block passes the prompt's tests (its record's `answer`: Python code,
    asserts on what the block defines) in the environment service's sandbox, else 0.0: a failed assert, an
    exception, a timeout, an exit before the tests ended, or no code block (nothing is run). A prompt without tests
    is an error. The reward server passes `environment_url` and `environment_token` (reward.function
    reinforce.reward.rewards:code_tests needs environment.enabled)."""
    missing = [i for i, a in enumerate(answers) if not a.strip()]
    if missing:
        raise ValueError(f"code_tests: {len(missing)} prompts without tests (their record's `answer`)")
    solutions = [final_code(r) for r in responses]
    # A loop of its own in a thread of its own: PyTriton calls reward functions from inside a running event loop,
    # where asyncio.run is refused.
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, _run_tests(solutions, answers, environment_url, environment_token)).result()


async def _run_tests(solutions: list[str | None], tests: list[str], url: str, token: str) -> list[float]:
    async with EnvironmentClient(url, token, timeout_s=CODE_TESTS_TIMEOUT_S) as env:

        async def passes(solution: str | None, test: str) -> float:
            if solution is None:
                return 0.0
            result = await env.run(checking_program(solution, test))
            return float(result.exit_code == 0 and not result.timed_out)

        return list(await asyncio.gather(*(passes(s, t) for s, t in zip(solutions, tests, strict=True))))


# ---------------------------------------------------------------------------------------------------------
# VADER


def vader_reward() -> RewardFn:
    """VADER compound sentiment of the response, in [-1, 1]; the prompt is ignored."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def score(prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        return [float(analyzer.polarity_scores(r)["compound"]) for r in responses]

    return score


# ---------------------------------------------------------------------------------------------------------
# Hugging Face sequence classifier

_HF_OPTIONS = {"input", "batch_size", "max_length"}


def hf_classifier_reward(
    path: str, label: int = -1, input: str = "pair", batch_size: int = 32, max_length: int = 512
) -> RewardFn:
    """Logit `label` of a local `AutoModelForSequenceClassification`, computed in batches.

    `input="pair"` feeds (prompt, response) as a text pair, the way preference reward models are trained;
    `input="response"` feeds the response alone, the way sentiment classifiers are used.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if input not in ("pair", "response"):
        raise RewardError(f"hf_classifier: input must be 'pair' or 'response', got {input!r}")
    # local_files_only: a reward server must never reach for a hub at run time.
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise RewardError(f"hf_classifier: cannot load a sequence classifier from {path}: {err}") from err
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    _ensure_padding(tokenizer, model)
    num_labels = int(model.config.num_labels)
    if not -num_labels <= label < num_labels:
        raise RewardError(f"hf_classifier: label {label} out of range for {num_labels} logits in {path}")
    max_length = min(max_length, getattr(tokenizer, "model_max_length", max_length) or max_length)

    @torch.no_grad()
    def score(prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        out: list[float] = []
        for start in range(0, len(responses), batch_size):
            texts = responses[start : start + batch_size]
            pairs = prompts[start : start + batch_size] if input == "pair" else None
            enc = tokenizer(
                pairs if pairs is not None else texts,
                texts if pairs is not None else None,
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            logits = model(**enc).logits
            out.extend(logits[:, label].float().cpu().tolist())
        return out

    return score


def _ensure_padding(tokenizer: Any, model: Any) -> None:
    # Decoder-only classifiers (Llama) ship without a pad token; batching needs one, and the model needs
    # its id to find each row's last real token.
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise RewardError("hf_classifier: the tokenizer has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


# ---------------------------------------------------------------------------------------------------------
# User callables


def import_function(ref: str) -> Callable[..., Any]:
    """Import `module:function`; errors name the reference."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward function {ref}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward function {ref}: module {module_name!r} has no callable {attr!r}")
    return fn


def python_reward(ref: str, kwargs: dict[str, Any]) -> RewardFn:
    fn = import_function(ref)
    try:
        wants_answers = "answers" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature (a builtin): prompts and responses only
        wants_answers = False

    def score(prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        if wants_answers:
            return fn(prompts, responses, answers=answers, **kwargs)
        return fn(prompts, responses, **kwargs)

    return score


# ---------------------------------------------------------------------------------------------------------


def checked(fn: RewardFn, name: str) -> RewardFn:
    """Wrap `fn` so that a result other than one real number per response is an error naming `name`."""

    def score(prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        answers = [""] * len(prompts) if answers is None else list(answers)
        if not len(prompts) == len(responses) == len(answers):
            raise RewardError(f"{name}: {len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
        return _as_floats(fn(list(prompts), list(responses), answers), len(responses), name)

    return score


def _as_floats(result: Any, expected: int, name: str) -> list[float]:
    if hasattr(result, "tolist"):  # numpy arrays and torch tensors
        result = result.tolist()
    if isinstance(result, str | bytes) or not isinstance(result, Sequence):
        raise RewardError(f"{name} returned {type(result).__name__}, expected a list of {expected} floats")
    if len(result) != expected:
        raise RewardError(f"{name} returned {len(result)} rewards for {expected} responses")
    bad = [(i, v) for i, v in enumerate(result) if not isinstance(v, numbers.Real)]
    if bad:
        i, v = bad[0]
        raise RewardError(f"{name} returned a non-numeric reward at row {i}: {v!r} ({type(v).__name__})")
    # float() keeps NaN and inf: they are the trainer's to handle.
    return [float(v) for v in result]


def build_reward_fn(spec: RewardSpec, environment: tuple[str, str] | None = None) -> RewardFn:
    """The reward function a spec describes, with its results checked. `environment`: the environment service's
    (url, token), which code_tests needs."""
    if spec.type == "vader":
        return checked(vader_reward(), "vader")
    if spec.type == "hf_classifier":
        unknown = set(spec.kwargs) - _HF_OPTIONS
        if unknown:
            raise RewardError(f"hf_classifier: unknown kwargs {sorted(unknown)} (known: {sorted(_HF_OPTIONS)})")
        assert spec.path is not None  # the spec's validator guarantees it
        return checked(hf_classifier_reward(spec.path, spec.label, **spec.kwargs), f"hf_classifier {spec.path}")
    assert spec.function is not None  # the spec's validator guarantees it
    kwargs = dict(spec.kwargs)
    if spec.function == CODE_TESTS_REWARD:
        if environment is None:
            raise RewardError(
                f"{CODE_TESTS_REWARD} runs the tests in the environment service: it needs --environment-url and "
                "$REINFORCE_ENVIRONMENT_TOKEN (environment.enabled)"
            )
        kwargs.update(environment_url=environment[0], environment_token=environment[1])
    return checked(python_reward(spec.function, kwargs), f"reward function {spec.function}")
