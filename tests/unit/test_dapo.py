"""DAPO's overlong reward shaping and dynamic sampling's filter, against values computed by hand."""

import pytest
import torch

from reinforce.core.records_pb2 import RolloutGroup, Sample
from reinforce.core.spec import parse_spec
from reinforce.trainer.algorithms.dapo import overlong_penalty, shaped_rewards, uninformative
from reinforce.trainer.batch import StepBatch

NAN = float("nan")


def test_overlong_penalty_is_linear_over_the_buffer():
    # L = 16, C = 4: no penalty up to 12 tokens, then -(|y| - 12) / 4 down to -1 at 16
    lengths = torch.tensor([10, 12, 13, 14, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def group(rewards: list[float], lengths: list[int] | None = None) -> RolloutGroup:
    lengths = lengths or [1] * len(rewards)
    samples = [Sample(token_ids=[2] * n, logprobs=[0.0] * n, reward=r) for r, n in zip(rewards, lengths, strict=True)]
    return RolloutGroup(prompt_id="0-0", prompt_token_ids=[1], samples=samples)


def test_shaped_rewards_add_the_penalty_to_kept_samples():
    spec = parse_spec(
        {
            "name": "t",
            "policy": {"random_init": {}},
            "data": {"prompts": "p.txt"},
            "generation": {"max_new_tokens": 16},
            "algorithm": {"num_rollouts_per_prompt": 3, "overlong_buffer": 4},
        }
    )
    batch = StepBatch.from_groups([group([1.0, 1.0, NAN], [12, 14, 16])])
    # 1 + 0, 1 - 0.5; the dropped sample stays 0 (it is not trained on)
    assert shaped_rewards(batch, spec).tolist() == [[1.0, 0.5, 0.0]]
    off = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"overlong_buffer": None})})
    assert shaped_rewards(batch, off) is batch.rewards


@pytest.mark.parametrize(
    ("rewards", "filtered"),
    [
        ([1.0, 1.0, 1.0], True),
        ([0.0, 1.0], False),
        ([1.0, NAN, 1.0], True),
        ([NAN, 1.0], True),
        ([0.5, NAN, 0.25], False),
    ],
)
def test_a_group_whose_rewards_are_all_equal_is_uninformative(rewards, filtered):
    assert uninformative(group(rewards)) is filtered
