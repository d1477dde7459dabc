"""Multi-turn rollouts (environment.enabled): each sample is an episode of the environment service.

An episode samples until the assistant turn ends (EOS, a stop string, a tool call's closing tag `</tool_call>`, or
the fence closing a ```python block: `holds_tool_call`, the environment's own reading of a call) and sends the turn
to the environment (core/environment_api.py), appends the observation's tokens and samples on, until
the environment answers `done` (a turn without a tool call, or the environment.max_turns-th turn) or the episode's
budget runs out: generation.max_new_tokens counts every response token, the model's and the tools'. A response that
ran out of budget did not end (`is_end` false), as a single-turn one cut by max_new_tokens.

The engine continues from token ids: turn t of an episode samples from the prompt's ids and all the episode's tokens
so far, so what the model saw is exactly the recorded trajectory. Its tokens are the model's own (loss mask 1, the
engine's log-probs); the observation's are the tools' (loss mask 0, log-prob 0: the trainer masks them out of every
loss, KL and metric).

An observation is rendered as the chat template renders a message of role `tool` after the assistant's turn (with
data.chat_template and a template that renders that role; the end-of-turn text the model already sampled, its EOS,
is not repeated), else in the plain format `PLAIN_FORMAT`, which the policy's tokenizer must be able to encode.

Episodes run round by round: every open episode samples its next turn in one engine call (a batch), then all of
them step the environment concurrently. A slow tool call holds its round back (no continuous batching yet).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from reinforce.core.environment_api import FENCE, TOOL_CALL_CLOSE, holds_tool_call
from reinforce.core.environment_client import EnvironmentClient
from reinforce.generator.engines.base import GenerationEngine, SampledSequence
from reinforce.generator.engines.common import sample_seeds

# An observation without a chat template: Hermes/Qwen's tool-response tags, on lines of their own.
PLAIN_FORMAT = ("\n<tool_response>\n", "\n</tool_response>\n")
# Placeholders rendered through the chat template to find the text around a tool message.
_ANSWER, _OUTPUT = "ANSWER_6c1f0e", "OUTPUT_6c1f0e"


@dataclass
class Episode:
    """One sample's trajectory: the response tokens (the model's turns and the tools' observations)."""

    prompt_ids: list[int]
    seed: int  # turn t samples under sample_seeds(seed, t + 1)[t]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)  # True: the model's token
    turns: int = 0
    tool_calls: int = 0
    is_end: bool = False
    done: bool = False
    episode_id: str = ""

    def add_turn(self, turn: SampledSequence) -> None:
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.loss_mask += [True] * len(turn.token_ids)
        self.turns += 1

    def add_observation(self, ids: list[int], budget: int) -> None:
        """The tool's tokens, as many as the budget leaves; a cut observation ends the episode unended."""
        kept = ids[: budget - len(self.token_ids)]
        self.token_ids += kept
        self.logprobs += [0.0] * len(kept)
        self.loss_mask += [False] * len(kept)
        self.tool_calls += 1
        if len(self.token_ids) >= budget:
            self.done = True


class ObservationFormat:
    """Renders an observation's text as the tokens appended after the assistant's turn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: bool, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.before, self.after = (chat_frame(tokenizer) if chat_template else None) or PLAIN_FORMAT

    def tokens(self, text: str, turn: list[int]) -> list[int]:
        before = self.before
        if turn and turn[-1] in self.eos_ids:  # the model closed its turn itself: do not close it again
            eos_text = self.tokenizer.decode(turn[-1:])
            before = before.removeprefix(eos_text)
        return self.tokenizer.encode(before + text + self.after, add_special_tokens=False)


def chat_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str] | None:
    """(text between an assistant's turn and a tool message's content, text after it up to the next assistant turn's
    start) as the tokenizer's chat template renders them; None when it has no template or no role `tool`."""
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": _ANSWER},
        {"role": "tool", "content": _OUTPUT},
    ]
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError):
        return None
    if not isinstance(text, str) or text.count(_ANSWER) != 1 or text.count(_OUTPUT) != 1:
        return None
    before, after = text.split(_ANSWER, 1)[1].split(_OUTPUT, 1)
    return before, after


class EpisodeRunner:
    """Runs a batch of episodes against the environment service with one engine."""

    def __init__(
        self, engine: GenerationEngine, observations: ObservationFormat, url: str, token: str, caller: str
    ) -> None:
        """caller: this generator's id, whose episodes the service keeps apart from every other caller's."""
        self.engine = engine
        self.observations = observations
        self.url = url
        self.token = token
        self.caller = caller

    def run(self, prompts: list[tuple[list[int], str, int]], k: int, temperature: float | None) -> list[list[Episode]]:
        """For each (prompt ids, prompt text, seed), k episodes. Raises EnvironmentServiceError (EpisodeLost when
        the service restarted) if the service fails: the caller redoes the whole batch."""
        return asyncio.run(self._run(prompts, k, temperature))

    async def _run(
        self, prompts: list[tuple[list[int], str, int]], k: int, temperature: float | None
    ) -> list[list[Episode]]:
        episodes = [[Episode(ids, s) for s in sample_seeds(seed, k)] for ids, _, seed in prompts]
        flat = [e for group in episodes for e in group]
        texts = [text for _, text, _ in prompts for _ in range(k)]
        async with EnvironmentClient(self.url, self.token, caller=self.caller) as env:
            try:
                resets = await asyncio.gather(*(env.reset(t) for t in texts), return_exceptions=True)
                for e, reset in zip(flat, resets, strict=True):
                    e.episode_id = "" if isinstance(reset, BaseException) else reset.episode_id
                _raise_first(resets)  # the episodes that did start are deleted below
                while open_ := [e for e in flat if not e.done]:
                    turns = self._sample_turns(open_, temperature)
                    steps = (self._step(env, e, turn) for e, turn in zip(open_, turns, strict=True))
                    _raise_first(await asyncio.gather(*steps, return_exceptions=True))
            finally:
                # The service would expire them; deleting frees their slots now. Best effort: it may be gone.
                await asyncio.gather(*(env.delete(e.episode_id) for e in flat if e.episode_id), return_exceptions=True)
        return episodes

    def _sample_turns(self, open_: list[Episode], temperature: float | None) -> list[SampledSequence]:
        """Each open episode's next turn. Engines stop at fixed strings only, so they stop at every fence: a turn
        stopped at a fence that closes no python block (an opening one) samples on, in as many calls as it takes."""
        turns = [SampledSequence([], [], True, "") for _ in open_]
        pending = list(range(len(open_)))
        segment = 0
        while pending:
            sampled = self.engine.sample(
                [open_[i].prompt_ids + open_[i].token_ids + turns[i].token_ids for i in pending],
                [_segment_seed(sample_seeds(open_[i].seed, open_[i].turns + 1)[-1], segment) for i in pending],
                num_samples=1,
                temperature=temperature,
                max_new_tokens=[self._left(open_[i], turns[i]) for i in pending],
                stop_strings=[TOOL_CALL_CLOSE, FENCE],
            )
            for i, (part,) in zip(pending, sampled, strict=True):
                turns[i] = self._joined(turns[i], part)
            pending = [i for i in pending if self._samples_on(open_[i], turns[i])]
            segment += 1
        return turns

    def _left(self, episode: Episode, turn: SampledSequence) -> int:
        return self.engine.generation.max_new_tokens - len(episode.token_ids) - len(turn.token_ids)

    def _joined(self, turn: SampledSequence, part: SampledSequence) -> SampledSequence:
        ids = turn.token_ids + part.token_ids  # decoded whole: a byte-level token may complete the part's first char
        text = self.observations.tokenizer.decode(ids, skip_special_tokens=True)
        return SampledSequence(ids, turn.logprobs + part.logprobs, part.is_end, text)

    def _samples_on(self, episode: Episode, turn: SampledSequence) -> bool:
        """The turn stopped at a fence that ends no call (not at EOS, a call's end or generation.stop_strings); with
        no budget left it is cut instead (not ended)."""
        if not turn.is_end or turn.token_ids[-1] in self.observations.eos_ids or holds_tool_call(turn.text):
            return False
        if any(s in turn.text for s in self.engine.generation.stop_strings):
            return False
        turn.is_end = self._left(episode, turn) > 0
        return turn.is_end

    async def _step(self, env: EnvironmentClient, episode: Episode, turn: SampledSequence) -> None:
        episode.add_turn(turn)
        if not turn.is_end:  # the budget ran out mid-turn
            episode.done = True
            return
        result = await env.step(episode.episode_id, turn.text)
        if result.done or result.observation is None:
            episode.done = episode.is_end = True
            return
        ids = self.observations.tokens(result.observation.text, turn.token_ids)
        episode.add_observation(ids, self.engine.generation.max_new_tokens)


def _segment_seed(turn_seed: int, segment: int) -> int:
    """The seed of a turn's segment-th engine call: the turn's own for the first, so a turn without a fence samples
    as it would without this split."""
    return turn_seed if segment == 0 else sample_seeds(turn_seed, segment + 1)[segment]


def _raise_first(results: list) -> None:
    """Every request of a round has finished (none is left running past the client); the first failure is raised."""
    if failed := next((r for r in results if isinstance(r, BaseException)), None):
        raise failed
