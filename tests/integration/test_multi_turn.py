"""Multi-turn episodes (generator/episodes.py) against a real environment service process, sampled by the real torch
engine from a tiny character-level policy fitted to one tool-using trajectory (so that greedy decoding calls the
calculator, reads its answer and answers): what the sample records, token by token, is checked against the text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reinforce.core.environment_client import EnvironmentServiceError
from reinforce.core.metrics import read_metrics
from reinforce.core.policy import build_char_tokenizer, load_policy, load_tokenizer, materialize_policy
from reinforce.core.run_dir import RunPaths
from reinforce.core.samples import read_samples, sample_steps
from reinforce.core.spec import GenerationSpec, PolicySpec, RandomInit
from reinforce.generator.engines.base import GenerationEngine
from reinforce.generator.engines.torch_engine import TorchEngine
from reinforce.generator.episodes import PLAIN_FORMAT, Episode, EpisodeRunner, ObservationFormat
from tests.integration.test_environment import TIME_LIMIT_S, TOKEN, Server, start_server
from tests.runs import assert_each_step_trained_once, assert_reward_rose, reinforce, write_spec

VOCAB = "abcdefghijklmnopqrstuvwxyzT0123456789 .,:+*=\"'{}[]()<>/_-?`\n"
PROMPT = "what is 2+3?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
OBSERVATION = PLAIN_FORMAT[0] + "5" + PLAIN_FORMAT[1]
ANSWER = "it is 5."
TOOL_USE = CALL + OBSERVATION + ANSWER
# The python tool as a fenced block, and no EOS after it: the turn ends at the closing fence, the model would write on.
PYTHON_PROMPT = "what is 2*3?"
PYTHON_USE = ("```python\nprint(2*3)\n```", PLAIN_FORMAT[0] + "6" + PLAIN_FORMAT[1], "it is 6.", None)
# A prompt and the response a policy is fitted to (texts, None for EOS), by the tool it calls.
TRAJECTORIES = {"calculator": (PROMPT, (TOOL_USE, None)), "python": (PYTHON_PROMPT, PYTHON_USE)}
# A program that never ends, as a fenced block: the turn ends where the fence closes (the model would write on), the
# environment's test server stops the program after 3 s.
HANG_PROMPT = "loop?"
HANG = "```python\nwhile True: pass\n```"
TIMEOUT = PLAIN_FORMAT[0] + f"[timeout after {TIME_LIMIT_S:g} s]" + PLAIN_FORMAT[1]


def fitted_policy(folder: Path, prompt: str = PROMPT, response: tuple[str | None, ...] = (TOOL_USE, None)) -> Path:
    """A tiny policy trained on `prompt` -> `response` (its texts, None for EOS) until greedy decoding repeats it
    (a few seconds): a real model that uses a tool."""
    init = RandomInit(vocab=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
    materialize_policy(PolicySpec(random_init=init), folder, seed=0)
    tokenizer, model = load_tokenizer(folder), load_policy(folder)
    ids = tokenizer.encode(prompt)
    for part in response:
        ids += [tokenizer.eos_token_id] if part is None else tokenizer.encode(part, add_special_tokens=False)
    ids = torch.tensor([ids])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fitted_policy(tmp_path_factory.mktemp("multi-turn") / "policy")


@pytest.fixture(scope="module")
def python_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fitted_policy(tmp_path_factory.mktemp("multi-turn-python") / "policy", *TRAJECTORIES["python"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("environment"))
    yield s
    s.process.terminate()
    s.process.wait(10)


def run_episodes(
    policy: Path,
    url: str,
    max_new_tokens: int,
    k: int = 2,
    prompt: str = PROMPT,
    engine: GenerationEngine | None = None,
) -> list[Episode]:
    """k greedy episodes of `prompt` (default engine: torch's)."""
    engine = engine or TorchEngine(policy, GenerationSpec(max_new_tokens=max_new_tokens), num_samples=k)
    tokenizer = load_tokenizer(policy)
    observations = ObservationFormat(tokenizer, chat_template=False, eos_ids={tokenizer.eos_token_id})
    runner = EpisodeRunner(engine, observations, url, TOKEN, caller="generator-0")
    [episodes] = runner.run([(tokenizer.encode(prompt), prompt, 11)], k=k, temperature=0)
    return episodes


def tool_segments(text: str) -> list[str]:
    """Each rendered observation in a response's text: from its opening to its closing, or to the text's end where the
    budget cut it."""
    segments, start = [], text.find(PLAIN_FORMAT[0])
    while start >= 0:
        end = text.find(PLAIN_FORMAT[1], start)
        end = len(text) if end < 0 else end + len(PLAIN_FORMAT[1])
        segments.append(text[start:end])
        start = text.find(PLAIN_FORMAT[0], end)
    return segments


def decoded(episode: Episode, trained: bool) -> str:
    tokenizer = build_char_tokenizer(VOCAB)
    ids = [t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True) if m == trained]
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_an_episode_calls_the_tool_reads_its_answer_and_the_mask_follows_the_text(policy: Path, server: Server) -> None:
    for episode in run_episodes(policy, server.url, max_new_tokens=160):
        assert (episode.turns, episode.tool_calls, episode.is_end) == (2, 1, True)
        # the model's tokens are its two turns; the tools' are the calculator's rendered answer, "5"
        assert decoded(episode, trained=True) == CALL + ANSWER
        assert decoded(episode, trained=False) == OBSERVATION
        first_tool = episode.loss_mask.index(False)
        assert build_char_tokenizer(VOCAB).decode(episode.token_ids[:first_tool]) == CALL
        assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if m)
        assert len(episode.token_ids) == len(episode.logprobs) == len(episode.loss_mask)


def test_the_budget_counts_the_tools_tokens_too(policy: Path, server: Server) -> None:
    """max_new_tokens is the whole response's: an observation that does not fit is cut, and the episode did not end."""
    budget = len(CALL) + 5
    for episode in run_episodes(policy, server.url, max_new_tokens=budget, k=1):
        assert len(episode.token_ids) == budget and not episode.is_end
        assert episode.loss_mask == [True] * len(CALL) + [False] * 5
        assert decoded(episode, trained=False) == OBSERVATION[:5]


def test_a_fenced_call_ends_its_turn_where_it_closes_and_the_budget_may_cut_it_at_the_opening(
    python_policy: Path, server: Server
) -> None:
    """The model writes on after its block (it was fitted without EOS there): the turn ends at the closing fence, the
    engine having stopped at the opening one first. With a budget of 3 tokens the turn stops at the opening fence with
    nothing left: it did not end, and no call was sent."""
    code, observation, answer, _ = PYTHON_USE
    [episode] = run_episodes(python_policy, server.url, max_new_tokens=160, k=1, prompt=PYTHON_PROMPT)
    assert (episode.turns, episode.tool_calls, episode.is_end) == (2, 1, True)
    assert decoded(episode, trained=True) == code + answer and decoded(episode, trained=False) == observation
    [cut] = run_episodes(python_policy, server.url, max_new_tokens=3, k=1, prompt=PYTHON_PROMPT)
    assert (decoded(cut, trained=True), cut.turns, cut.tool_calls, cut.is_end) == ("```", 1, 0, False)


def test_a_hanging_tool_is_cut_at_its_time_limit_and_the_model_reads_timeout(tmp_path: Path, server: Server) -> None:
    policy = fitted_policy(tmp_path / "policy", HANG_PROMPT, (HANG, TIMEOUT, "stuck.", None))
    start = time.monotonic()
    [episode] = run_episodes(policy, server.url, max_new_tokens=120, k=1, prompt=HANG_PROMPT)
    assert TIME_LIMIT_S <= time.monotonic() - start < TIME_LIMIT_S + 30
    assert (episode.turns, episode.tool_calls, episode.is_end) == (2, 1, True)
    assert decoded(episode, trained=True) == HANG + "stuck."
    assert decoded(episode, trained=False) == TIMEOUT


def test_a_service_that_is_gone_fails_the_batch(policy: Path, tmp_path: Path) -> None:
    """The generator redoes the whole batch then (worker.py): no episode is half recorded."""
    gone = start_server(tmp_path)
    gone.process.kill()
    gone.process.wait(10)
    with pytest.raises(EnvironmentServiceError):
        run_episodes(policy, gone.url, max_new_tokens=160)


@pytest.mark.slow
def test_tiny_tools_example_learns_to_call_the_calculator(tmp_path: Path) -> None:
    """examples/tiny-tools.yaml through the real processes (environment service included): the reward, the record's
    answer checked against the trajectory's last number, rises, and in the samples the trainer kept, the tools'
    tokens (loss mask 0) are exactly the calculator's rendered answers in the text."""
    result = reinforce("run", str(write_spec(tmp_path, "tiny-tools")))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(tmp_path / "run")
    rows = read_metrics(paths.metrics)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert_reward_rose(rows, by=0.2)
    assert rows[0]["train_rollouts/dropped_nonfinite_rewards"] == 0  # every prompt's answer reached the reward
    assert_each_step_trained_once(tmp_path / "run", steps=30)
    samples = [row for step in sample_steps(paths) for row in read_samples(paths, step)]
    called = [s for s in samples if s["tool_calls"] > 0]
    assert called
    answer = PLAIN_FORMAT[0] + "81" + PLAIN_FORMAT[1]  # the calculator's, as the generator renders it
    for sample in called:
        text, segments = sample["response"], tool_segments(sample["response"])
        assert all(answer.startswith(segment) for segment in segments)  # a character is a token
        # the budget may cut the last answer inside its opening, which tool_segments does not see: it ends the text
        cut = sample["tool_tokens"] - sum(map(len, segments))
        assert cut >= 0 and len(segments) + (cut > 0) == sample["tool_calls"]
        if cut:
            assert not sample["is_end"] and sample["response_tokens"] == 48 and text.endswith(answer[:cut])
        assert sample["turns"] in (1, 2)
    assert all(s["tool_tokens"] == 0 for s in samples if s["tool_calls"] == 0)


def test_a_batch_the_service_refuses_in_part_leaves_no_episode_open(policy: Path, server: Server) -> None:
    """The service has room for 2 more episodes (max_episodes 8) and a batch asks for 4: two resets are refused
    (429), the batch fails whole, and the two episodes that did start are deleted, not left to expire."""

    async def fill(n: int) -> list[tuple[str, str]]:  # by two callers: each holds at most max_episodes_per_caller
        held = []
        for i in range(n):
            async with server.client(caller := f"filler-{i % 2}") as env:
                held.append((caller, (await env.reset("x")).episode_id))
        return held

    async def empty(held: list[tuple[str, str]]) -> None:
        for caller, episode_id in held:
            async with server.client(caller) as env:
                await env.delete(episode_id)

    held = asyncio.run(fill(6))
    try:
        with pytest.raises(EnvironmentServiceError, match="429"):
            run_episodes(policy, server.url, max_new_tokens=160, k=4)
        assert server.metric("reinforce_environment_open_episodes") == 6
    finally:
        asyncio.run(empty(held))
