"""Checking a rollout group before the trainer spends anything on it.

Any process that can write to the run's Redis (every generator can) can push a RolloutGroup. One that decodes but
does not fit the step it claims (too few samples, a log-prob per token missing, a token id past the vocabulary, a
3,000-token response when max_new_tokens is 16, NaN log-probs, a weight version from the future) would crash the
trainer, cost it a restart, or poison its update. `group_problem` names what is wrong, and the collector moves such
a group to the dead-letter stream with that reason, before any forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reinforce.core.records_pb2 import Prompt, PromptKind, RolloutGroup, Sample
from reinforce.core.spec import RunSpec

# A log-prob is log of a probability: <= 0, up to the rounding of the engine that computed it.
LOGPROB_TOLERANCE = 1e-3


@dataclass(frozen=True)
class GroupLimits:
    """What a well-formed group of this run looks like."""

    samples_per_group: int  # algorithm.num_rollouts_per_prompt
    max_response_tokens: int  # generation.max_new_tokens
    max_prompt_tokens: int  # data.max_prompt_tokens
    vocab_size: int  # the policy's embedding rows
    prompts_per_step: int
    max_policy_lag: int

    @classmethod
    def of(cls, spec: RunSpec, vocab_size: int) -> GroupLimits:
        return cls(
            samples_per_group=spec.algorithm.num_rollouts_per_prompt,
            max_response_tokens=spec.generation.max_new_tokens,
            max_prompt_tokens=spec.data.max_prompt_tokens,
            vocab_size=vocab_size,
            # dynamic sampling's replacements take the next indices (trainer/dynamic_sampling.py)
            prompts_per_step=spec.training.prompts_per_step
            + spec.algorithm.dynamic_sampling * spec.algorithm.max_filtered_groups,
            max_policy_lag=spec.algorithm.max_policy_lag,
        )


def max_group_bytes(limits: GroupLimits) -> int:
    """A generous bound on a well-formed group's serialised size: up to 128 bytes per token (id, log-prob and
    decoded text) and 1 MiB for the prompt's text and the rest. Larger records are refused before parsing."""
    tokens = limits.max_prompt_tokens + limits.samples_per_group * limits.max_response_tokens
    return (1 << 20) + 128 * tokens


def group_problem(group: RolloutGroup, limits: GroupLimits, published: int, enqueued: Prompt | None) -> str:
    """Why `group` cannot be trained on ("" when it can). `published`: the newest weight version the trainer has
    published; `enqueued`: the prompt the trainer enqueued under the group's id, where this process knows it."""
    return (
        identity_problem(group, limits)
        or _version_problem(group, published)
        or content_problem(group, limits, limits.samples_per_group, enqueued)
    )


def content_problem(group: RolloutGroup, limits: GroupLimits, num_samples: int, enqueued: Prompt | None) -> str:
    """Why the samples and prompt of `group` cannot be scored ("" when they can): also for validation groups."""
    if len(group.samples) != num_samples:
        return f"{len(group.samples)} samples, expected {num_samples}"
    return _prompt_problem(group, limits, enqueued) or next(
        (p for i, s in enumerate(group.samples) if (p := _sample_problem(i, s, limits))), ""
    )


def identity_problem(group: RolloutGroup, limits: GroupLimits) -> str:
    """Why `group` answers no prompt this run could have enqueued ("" when it could have)."""
    step, _, index = group.prompt_id.partition("-")
    if not (step.isdigit() and index.isdigit()) or int(index) >= limits.prompts_per_step:
        return f"prompt_id {group.prompt_id!r} is not <step>-<index> with index < {limits.prompts_per_step}"
    if int(step) != group.step:
        return f"step {group.step} differs from its prompt_id {group.prompt_id!r}"
    if group.kind != PromptKind.TRAIN:
        return "a validation group in the rollouts stream"
    return ""


def _version_problem(group: RolloutGroup, published: int) -> str:
    if group.policy_version > published:
        return f"policy_version {group.policy_version} was never published (newest: {published})"
    return ""


def _prompt_problem(group: RolloutGroup, limits: GroupLimits, enqueued: Prompt | None) -> str:
    if enqueued is not None and list(group.prompt_token_ids) != list(enqueued.token_ids):
        return "prompt_token_ids differ from the prompt the trainer enqueued"
    if enqueued is not None and group.prompt_text != enqueued.text:
        return "prompt_text differs from the prompt the trainer enqueued"
    if not 0 < len(group.prompt_token_ids) <= limits.max_prompt_tokens:
        return f"{len(group.prompt_token_ids)} prompt tokens, expected 1 to max_prompt_tokens"
    return _ids_problem("prompt", group.prompt_token_ids, limits.vocab_size)


def _sample_problem(i: int, sample: Sample, limits: GroupLimits) -> str:
    tokens, logprobs = len(sample.token_ids), len(sample.logprobs)
    if tokens > limits.max_response_tokens:
        return f"sample {i}: {tokens} response tokens, more than max_new_tokens = {limits.max_response_tokens}"
    if logprobs != tokens:
        return f"sample {i}: {logprobs} log-probs for {tokens} tokens"
    # multi-turn: one entry per token (the tools' tokens, 0, count against max_new_tokens too); empty: single-turn
    if sample.loss_mask and len(sample.loss_mask) != tokens:
        return f"sample {i}: a loss mask of {len(sample.loss_mask)} entries for {tokens} tokens"
    if not all(math.isfinite(x) and x <= LOGPROB_TOLERANCE for x in sample.logprobs):
        return f"sample {i}: a log-prob that is NaN, infinite or above 0"
    return _ids_problem(f"sample {i}", sample.token_ids, limits.vocab_size)


def _ids_problem(what: str, ids: list[int], vocab_size: int) -> str:
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        return f"{what}: a token id outside the vocabulary [0, {vocab_size})"
    return ""
