"""algorithm.loss_aggregation: each mode against a hand-computed example, and the spec's checks."""

import pytest
import torch

from reinforce.core.spec import SpecError, parse_spec
from reinforce.trainer.algorithms.aggregation import LossNormalizer, step_normalizer

# Two samples: 3 tokens and 1 token; the padded position holds inf, which must not leak in (no nan).
TERMS = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("inf"), float("inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
MINIMAL = {"name": "t", "policy": {"random_init": {}}, "data": {"prompts": "p.txt"}}


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),  # every token the same weight
        ("sequence_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # every sample the same weight
        ("constant", (1 + 2 + 3 + 4) / (2 * 8)),  # Dr. GRPO: S * C, C = 8
    ],
)
def test_each_mode_by_hand(aggregation: str, expected: float):
    normalizer = LossNormalizer(aggregation, num_tokens=4, num_samples=2, constant=8.0)
    assert normalizer.reduce(TERMS, MASK).item() == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_add_up_to_the_step(aggregation: str):
    """Each micro-batch divides by the step's N and S, so the parts sum to the whole batch's loss."""
    normalizer = LossNormalizer(aggregation, num_tokens=4, num_samples=2, constant=8.0)
    parts = normalizer.reduce(TERMS[:1], MASK[:1]) + normalizer.reduce(TERMS[1:], MASK[1:])
    assert parts.item() == pytest.approx(normalizer.reduce(TERMS, MASK).item())


def test_constant_with_normalizer_one_is_trl_rloo():
    """TRL RLOOTrainer: each sample's log-prob sum times its advantage, averaged over samples."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    advantages = torch.tensor([0.5, -1.0])
    trl = -((logprobs * MASK).sum(-1) * advantages).mean()
    ours = -LossNormalizer("constant", 4, 2, constant=1.0).reduce(logprobs * advantages[:, None], MASK)
    assert ours.item() == pytest.approx(trl.item())


def test_constant_defaults_to_max_new_tokens():
    spec = parse_spec({**MINIMAL, "algorithm": {"loss_aggregation": "constant"}, "generation": {"max_new_tokens": 24}})
    assert step_normalizer(spec, 10, 2).constant == 24.0
    spec = parse_spec({**MINIMAL, "algorithm": {"loss_aggregation": "constant", "loss_normalizer": 1}})
    assert step_normalizer(spec, 10, 2).constant == 1.0


def test_normalizer_without_constant_is_refused():
    with pytest.raises(SpecError, match="loss_normalizer applies to loss_aggregation constant only"):
        parse_spec({**MINIMAL, "algorithm": {"loss_aggregation": "sequence_mean", "loss_normalizer": 4}})
    with pytest.raises(SpecError, match=r"algorithm\.loss_aggregation"):
        parse_spec({**MINIMAL, "algorithm": {"loss_aggregation": "seq-mean-token-mean"}})
