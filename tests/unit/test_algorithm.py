"""The REINFORCE/RLOO math against values computed by hand."""

import math

import pytest
import torch

from reinforce.core.spec import LossAggregation
from reinforce.trainer.algorithms.aggregation import LossNormalizer
from reinforce.trainer.algorithms.ppo import clipped_surrogate
from reinforce.trainer.algorithms.reinforce import (
    importance_ratio,
    policy_gradient_loss,
    rloo_advantages,
    rloo_baseline,
)
from reinforce.trainer.algorithms.tensors import kl_per_token, masked_mean, sequence_kl

# d = logprobs - ref = [0.5, -0.5, (padding)]
LOGPROBS = torch.tensor([[-1.0, -2.0, -3.0]])
REF = torch.tensor([[-1.5, -1.5, 99.0]])  # the padded position holds garbage that must not leak in
MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    ("estimator", "absolute", "expected"),
    [
        ("k1", True, 0.5),
        ("k1", False, 0.0),
        ("k2", False, 0.125),
        ("k3", False, ((math.exp(-0.5) - 0.5) + (math.exp(0.5) - 1.5)) / 2),
    ],
)
def test_sequence_kl_estimators(estimator, absolute, expected):
    kl = sequence_kl(LOGPROBS, REF, MASK, estimator, absolute)
    assert kl.shape == (1,)
    assert kl.item() == pytest.approx(expected, abs=1e-6)


def test_k2_and_k3_ignore_use_absolute_kl():
    d_pos = kl_per_token(torch.tensor([0.3]), torch.tensor([0.0]), "k3", True)
    d_neg = kl_per_token(torch.tensor([0.3]), torch.tensor([0.0]), "k3", False)
    assert d_pos.item() == d_neg.item() == pytest.approx(math.exp(-0.3) - 1 + 0.3)


def test_masked_mean_of_empty_response_is_zero():
    assert masked_mean(torch.tensor([[5.0, 7.0]]), torch.tensor([[0, 0]])).item() == 0.0


def test_rloo_all_ended_is_mean_of_others():
    r = torch.tensor([[1.0, 2.0, 4.0]])
    b = rloo_baseline(r, torch.tensor([[True, True, True]]))
    assert b.tolist() == [[3.0, 2.5, 1.5]]


def test_rloo_unended_sample_gets_true_mean_of_ended_others():
    r = torch.tensor([[1.0, 2.0, 4.0]])
    b = rloo_baseline(r, torch.tensor([[True, True, False]]))
    # ended samples see the one other ended sample; the unended one sees the mean of both (not 3 / (M-1)).
    assert b.tolist() == [[2.0, 1.0, 1.5]]


def test_rloo_fewer_than_two_ended_gives_zero_advantage():
    r = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    adv = rloo_advantages(r, torch.zeros_like(r), torch.tensor([[True, False, False], [False] * 3]), 0.1)
    assert torch.equal(adv.advantages, torch.zeros_like(r))


def test_rloo_single_sample_per_prompt_has_zero_advantage():
    r = torch.tensor([[1.0], [2.0]])
    adv = rloo_advantages(r, torch.zeros_like(r), torch.tensor([[True], [True]]), 0.0)
    assert torch.equal(adv.advantages, torch.zeros_like(r))


def test_rloo_groups_are_independent():
    r = torch.tensor([[1.0, 3.0], [10.0, 30.0]])
    b = rloo_baseline(r, torch.ones_like(r, dtype=torch.bool))
    assert b.tolist() == [[3.0, 1.0], [30.0, 10.0]]


def test_rewards_with_kl_and_advantages():
    r = torch.tensor([[1.0, 0.0]])
    kl = torch.tensor([[0.5, 1.0]])
    adv = rloo_advantages(r, kl, torch.tensor([[True, True]]), kl_penalty=0.1)
    assert adv.rewards_with_kl.tolist()[0] == pytest.approx([0.95, -0.1])
    assert adv.advantages.tolist()[0] == pytest.approx([1.05, -1.05])


def test_advantages_carry_no_gradient():
    r = torch.tensor([[1.0, 2.0]], requires_grad=True)
    kl = torch.tensor([[0.1, 0.2]], requires_grad=True)
    adv = rloo_advantages(r, kl, torch.tensor([[True, True]]), 0.1)
    assert not adv.advantages.requires_grad


def test_policy_gradient_loss_is_masked_token_mean():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, 123.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -2.0])
    # -( (-1 - 2) * 1 + (-3) * -2 ) / 3 tokens
    assert policy_gradient_loss(logprobs, adv, mask, LossNormalizer("token_mean", 3, 2)).item() == pytest.approx(-1.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_sum_to_full_batch_gradient(aggregation: LossAggregation):
    torch.manual_seed(0)
    logits = torch.randn(6, 5, requires_grad=True)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 5, [1, 0, 0, 0, 0], [1] * 2 + [0] * 3])
    adv = torch.randn(6)
    n = LossNormalizer(aggregation, int(mask.sum()), 6, constant=5.0)
    policy_gradient_loss(torch.log_softmax(logits, -1), adv, mask, n).backward()
    full_grad = logits.grad.clone()
    logits.grad = None
    for rows in (slice(0, 4), slice(4, 6)):
        policy_gradient_loss(torch.log_softmax(logits, -1)[rows], adv[rows], mask[rows], n).backward()
    assert torch.allclose(logits.grad, full_grad, atol=1e-7)


def test_gradient_raises_logprob_of_positive_advantage():
    logit = torch.zeros(1, 2, requires_grad=True)
    logprob = torch.log_softmax(logit, -1)[:, :1]  # log pi of token 0
    policy_gradient_loss(logprob, torch.tensor([1.0]), torch.ones(1, 1), LossNormalizer("token_mean", 1, 1)).backward()
    # gradient descent on the loss moves logit 0 up and logit 1 down
    assert logit.grad[0, 0] < 0 < logit.grad[0, 1]


def test_kl_clamp_bounds_every_estimator_at_the_edge():
    d = torch.tensor([-15.0, -10.0, 9.99, 10.5])
    zero = torch.zeros(4)
    # k3 at d = -15: exp(15) - 1 - 15 = 3269001.37 unclamped (one token would swamp a batch), 10 clamped
    assert kl_per_token(d, zero, "k3", False)[0].item() == pytest.approx(math.exp(15) - 16, rel=1e-6)
    assert kl_per_token(d, zero, "k3", False, clamp=10.0).tolist()[0] == 10.0
    # signed k1 is clamped on both sides; exactly 10 stays 10, 9.99 is untouched
    assert kl_per_token(d, zero, "k1", False, clamp=10.0).tolist() == pytest.approx([-10.0, -10.0, 9.99, 10.0])
    assert kl_per_token(d, zero, "k1", True, clamp=10.0).tolist() == pytest.approx([10.0, 10.0, 9.99, 10.0])
    # k2: d^2 / 2 = 112.5, 50, 49.9 and 55.125 all above 10
    assert kl_per_token(d, zero, "k2", False, clamp=10.0).tolist() == [10.0] * 4
    # the sequence KL averages the clamped estimate: (10 + 10 + 9.99 + 10) / 4
    assert sequence_kl(d[None], zero[None], torch.ones(1, 4), "k1", True, 10.0).item() == pytest.approx(9.9975)


# log pi - log mu = [0.1, -0.2] on two real tokens, then padding whose log-prob is garbage
POLICY = torch.tensor([[-1.0, -2.0, -math.inf]])
BEHAVIOUR = torch.tensor([[-1.1, -1.8, 0.0]])
TWO_TOKENS = torch.tensor([[1, 1, 0]])


def test_token_ratio_is_pi_over_mu_per_token():
    ratio = importance_ratio(POLICY, BEHAVIOUR, TWO_TOKENS, "clip")
    assert ratio.tolist()[0] == pytest.approx([math.exp(0.1), math.exp(-0.2), 1.0])  # 1.1051709, 0.8187308


def test_gspo_ratio_is_the_length_normalised_sequence_ratio_with_its_gradient():
    logprobs = POLICY.clone().requires_grad_()
    ratio = importance_ratio(logprobs, BEHAVIOUR, TWO_TOKENS, "gspo")
    s = math.exp((0.1 - 0.2) / 2)  # exp(mean log-ratio) = exp(-0.05) = 0.9512294 on every token of the sequence
    assert ratio.tolist()[0][:2] == pytest.approx([s, s])
    ratio[0, :2].sum().backward()
    # each token's term carries s_i * pi / sg[pi]: d/dlog pi_t = s_i; padding gets no (nan) gradient
    assert logprobs.grad.tolist()[0] == pytest.approx([s, s, 0.0])


def test_gspo_clips_whole_sequences_with_its_small_range():
    ratio = importance_ratio(POLICY, BEHAVIOUR, TWO_TOKENS, "gspo")  # 0.9512294 < 1 - 3e-4
    advantages = torch.tensor([[1.0, 1.0, 0.0]])
    terms, clamped, clipped = clipped_surrogate(ratio, advantages, (3e-4, 4e-4))
    # A > 0 and s below the range: -A * s = -0.9512294 beats -A * 0.9997, the sequence is not clipped
    assert terms.tolist()[0][:2] == pytest.approx([-0.9512294] * 2, abs=1e-6)
    assert clamped.tolist()[0][:2] == pytest.approx([0.9997, 0.9997])
    # A < 0: -A * clip(s) = 0.9997 wins over 0.9512294 for every token of the sequence: no gradient from it
    terms, _, clipped = clipped_surrogate(ratio, -advantages, (3e-4, 4e-4))
    assert clipped.tolist()[0][:2] == [True, True]
    assert terms.tolist()[0][:2] == pytest.approx([0.9997, 0.9997])


def test_clip_higher_lets_a_rising_ratio_through_that_the_symmetric_clip_stops():
    ratio, positive = torch.tensor([1.25]), torch.tensor([1.0])
    # eps_high 0.28 (DAPO): 1.25 is inside, the term is -1.25 with gradient; symmetric 0.2: -1.2 wins, clipped
    terms, _, clipped = clipped_surrogate(ratio, positive, (0.2, 0.28))
    assert terms.tolist() == [-1.25] and clipped.tolist() == [False]
    terms, _, clipped = clipped_surrogate(ratio, positive, (0.2, 0.2))
    assert terms.tolist() == pytest.approx([-1.2]) and clipped.tolist() == [True]
    # the low side still clips at 1 - eps_low: rho 0.75 with A < 0 gives 0.8
    terms, _, clipped = clipped_surrogate(torch.tensor([0.75]), -positive, (0.2, 0.28))
    assert terms.tolist() == pytest.approx([0.8]) and clipped.tolist() == [True]
