"""A rollout group is checked against the run before the trainer spends anything on it (issue 30: R3-3, R3-4, R3-5)."""

from __future__ import annotations

import math

import pytest

from reinforce.core.records_pb2 import Prompt, PromptKind, RolloutGroup, Sample
from reinforce.trainer.group_check import GroupLimits, group_problem, max_group_bytes

LIMITS = GroupLimits(
    samples_per_group=4, max_response_tokens=16, max_prompt_tokens=32, vocab_size=35, prompts_per_step=8,
    max_policy_lag=1,
)  # fmt: skip
PROMPT = Prompt(id="3-2", step=3, policy_version=2, text="hi", token_ids=[1, 5, 6], num_samples=4)


def good_group() -> RolloutGroup:
    samples = [Sample(token_ids=[7, 8, 2], logprobs=[-0.5, -1.0, -0.1], reward=0.5, is_end=True) for _ in range(4)]
    return RolloutGroup(prompt_id="3-2", step=3, policy_version=3, prompt_text="hi", prompt_token_ids=[1, 5, 6],
                        samples=samples)  # fmt: skip


def test_a_well_formed_group_passes() -> None:
    assert group_problem(good_group(), LIMITS, published=3, enqueued=PROMPT) == ""
    assert group_problem(good_group(), LIMITS, published=3, enqueued=None) == ""


def _broken(change) -> RolloutGroup:
    group = good_group()
    change(group)
    return group


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # R3-3: a weight version the trainer never published
        (lambda g: setattr(g, "policy_version", 999999), "policy_version 999999 was never published"),
        # R3-4: NaN generator log-probs
        (lambda g: g.samples[1].logprobs.__setitem__(0, math.nan), "sample 1: a log-prob that is NaN"),
        (lambda g: g.samples[0].logprobs.__setitem__(0, 0.5), "above 0"),
        # R3-5: malformed groups that crashed the trainer or blew up its memory
        (lambda g: g.samples.pop(), "3 samples, expected 4"),
        (lambda g: g.samples[2].logprobs.extend([-1.0] * 47), "sample 2: 50 log-probs for 3 tokens"),
        (lambda g: g.samples[0].token_ids.__setitem__(1, 1_000_000), "outside the vocabulary [0, 35)"),
        (
            lambda g: (g.samples[3].token_ids.extend([1] * 2997), g.samples[3].logprobs.extend([-1.0] * 2997)),
            "sample 3: 3000 response tokens, more than max_new_tokens = 16",
        ),
        (lambda g: setattr(g, "prompt_id", "3-9"), "index < 8"),
        (lambda g: setattr(g, "prompt_id", "x"), "is not <step>-<index>"),
        (lambda g: setattr(g, "step", 4), "step 4 differs from its prompt_id"),
        (lambda g: setattr(g, "kind", PromptKind.VALIDATION), "a validation group in the rollouts stream"),
        (lambda g: g.prompt_token_ids.append(9), "prompt_token_ids differ from the prompt the trainer enqueued"),
        (lambda g: setattr(g, "prompt_text", "other"), "prompt_text differs"),
    ],
)
def test_each_malformed_group_is_named(change, reason: str) -> None:
    assert reason in group_problem(_broken(change), LIMITS, published=3, enqueued=PROMPT)


def test_where_the_enqueued_prompt_is_unknown_its_ids_are_still_bounded() -> None:
    """Data-parallel ranks other than the main one do not enqueue, so they check bounds only."""
    group = _broken(lambda g: g.prompt_token_ids.__setitem__(0, 35))
    assert "prompt: a token id outside the vocabulary" in group_problem(group, LIMITS, published=3, enqueued=None)
    group = _broken(lambda g: g.prompt_token_ids.extend([1] * 40))
    assert "43 prompt tokens, expected 1 to max_prompt_tokens" in group_problem(group, LIMITS, 3, None)


def test_a_record_far_larger_than_any_group_of_the_run_is_over_the_byte_cap() -> None:
    cap = max_group_bytes(LIMITS)
    assert good_group().ByteSize() < cap < 200 * 2**20


def multi_turn_group() -> RolloutGroup:
    """Episodes of 16 tokens, the budget: two model turns around a tool's 6-token observation (log-prob 0)."""
    group = good_group()
    for sample in group.samples:
        mask = [True] * 5 + [False] * 6 + [True] * 5
        sample.token_ids[:] = [7] * 16
        sample.logprobs[:] = [-0.5 if trained else 0.0 for trained in mask]
        sample.loss_mask[:] = mask
    return group


def test_a_multi_turn_group_within_the_budget_passes_and_its_mask_must_cover_every_token() -> None:
    assert group_problem(multi_turn_group(), LIMITS, published=3, enqueued=PROMPT) == ""
    group = multi_turn_group()
    group.samples[2].loss_mask.pop()
    assert "sample 2: a loss mask of 15 entries for 16 tokens" in group_problem(group, LIMITS, 3, PROMPT)
