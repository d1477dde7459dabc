"""The PPO math against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from reinforce.critic.value_model import critic_loss
from reinforce.trainer.algorithms.aggregation import LossNormalizer
from reinforce.trainer.algorithms.ppo import generalized_advantages, ppo_policy_loss, token_rewards
from reinforce.trainer.algorithms.tensors import masked_mean_var, masked_whiten
from reinforce.trainer.chunked_head import token_entropy

INF = float("inf")


def test_token_rewards_penalise_kl_and_put_the_score_on_the_last_real_token():
    rewards = torch.tensor([2.0, -1.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, INF], [INF, INF, INF]])  # padding holds garbage
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # lengths 3, 2 and an empty response
    r = token_rewards(rewards, kl, mask, kl_penalty=0.5)
    # row 0: -0.5 * [0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15], + 2.0 on t = 2
    # row 1: -0.5 * [0.4, 0.5] = [-0.2, -0.25], - 1.0 on t = 1; padding 0
    # row 2: no token to carry the score: all 0
    expected = torch.tensor([[-0.05, -0.1, 1.85], [-0.2, -1.25, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(r, expected, atol=1e-6)


def test_gae_with_gamma_and_lambda_below_one_and_padding():
    gamma, lam = 0.9, 0.8  # gamma * lambda = 0.72
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 2.0, 77.0]])
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.2, 0.5, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = generalized_advantages(values, rewards, mask, gamma, lam)
    # row 0: delta_2 = 1.0 + 0.9 * 0 - 0.3 = 0.7                 A_2 = 0.7
    #        delta_1 = -0.2 + 0.9 * 0.3 - 0.4 = -0.33            A_1 = -0.33 + 0.72 * 0.7 = 0.174
    #        delta_0 = 0.1 + 0.9 * 0.4 - 0.5 = -0.04             A_0 = -0.04 + 0.72 * 0.174 = 0.08528
    # row 1 (n = 2, V(s_2) = 0 although the padded value is 77):
    #        delta_1 = 0.5 + 0.9 * 0 - 2.0 = -1.5                A_1 = -1.5
    #        delta_0 = 0.2 + 0.9 * 2.0 - 1.0 = 1.0               A_0 = 1.0 + 0.72 * -1.5 = -0.08
    assert torch.allclose(adv, torch.tensor([[0.08528, 0.174, 0.7], [-0.08, -1.5, 0.0]]), atol=1e-6)
    # R = A + V: [0.58528, 0.574, 1.0] and [0.92, 0.5, 0 (padding)]
    assert torch.allclose(ret, torch.tensor([[0.58528, 0.574, 1.0], [0.92, 0.5, 0.0]]), atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    # lambda = gamma = 1: A_t = sum_{u >= t} r_u - V(s_t), the Monte Carlo advantage
    values = torch.tensor([[0.5, 0.25]])
    rewards = torch.tensor([[1.0, 2.0]])
    adv, ret = generalized_advantages(values, rewards, torch.ones(1, 2), 1.0, 1.0)
    assert adv.tolist() == [[2.5, 1.75]]  # 3 - 0.5, 2 - 0.25
    assert ret.tolist() == [[3.0, 2.0]]


def test_gae_carries_no_gradient():
    values = torch.tensor([[0.5, 0.4]], requires_grad=True)
    adv, ret = generalized_advantages(values, torch.ones(1, 2), torch.ones(1, 2), 0.9, 0.9)
    assert not adv.requires_grad and not ret.requires_grad


def test_whitening_uses_masked_mean_and_uncorrected_variance():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, INF]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    mean, var = masked_mean_var(values, mask)
    # unmasked 1, 2, 3, 4: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, / 4 (not 3) = 1.25
    assert mean.item() == pytest.approx(2.5)
    assert var.item() == pytest.approx(1.25)
    white = masked_whiten(values, mask)
    # (x - 2.5) / sqrt(1.25 + 1e-8) = (x - 2.5) / 1.1180340: -1.3416408, -0.4472136, 0.4472136, 1.3416408
    expected = torch.tensor([[-1.3416408, -0.4472136, 0.4472136], [1.3416408, 0.0, 0.0]])
    assert torch.allclose(white, expected, atol=1e-6)


def test_whitening_constant_advantages_gives_zeros_not_nan():
    white = masked_whiten(torch.full((2, 3), 0.7), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert torch.equal(white, torch.zeros(2, 3))


# Four real tokens and eps = 0.2 (ratios 1 +- 0.2):
#   t1: A = +1, rho = 1.5: max(-1.5, -1.2) = -1.2   clipped (rho above 1 + eps with A > 0): no gradient
#   t2: A = +1, rho = 0.5: max(-0.5, -0.8) = -0.5   not clipped (a low ratio with A > 0 is not limited)
#   t3: A = -2, rho = 0.5: max( 1.0,  1.6) =  1.6   clipped (rho below 1 - eps with A < 0): no gradient
#   t4: A = -2, rho = 1.1: max( 2.2,  2.2) =  2.2   inside the clip range
# loss = (-1.2 - 0.5 + 1.6 + 2.2) / 4 = 2.1 / 4 = 0.525
RATIOS = [[1.5, 0.5], [0.5, 1.1]]
ADVANTAGES = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, 0.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def _logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0]])
    log_ratio = torch.tensor([[math.log(x) for x in row] + [200.0] for row in RATIOS])  # padding: exp overflows
    return (old + log_ratio).requires_grad_(), old


def test_clipped_policy_loss_both_sides_of_the_clip():
    logprobs, old = _logprobs()
    out = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, clip=(0.2, 0.2))
    assert out.loss.item() == pytest.approx(0.525, abs=1e-6)
    assert out.ppo_ratio.item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.1) / 4, abs=1e-6)  # 0.9
    assert out.ppo_ratio_clamped.item() == pytest.approx((1.2 + 0.8 + 0.8 + 1.1) / 4, abs=1e-6)  # 0.975
    assert out.clip_fraction.item() == pytest.approx(0.5)  # t1 and t3
    assert out.entropy is None
    out.loss.backward()
    # d/dlog pi of -A * rho / 4 is -A * rho / 4 where unclipped: t2 -1 * 0.5 / 4 = -0.125, t4 2 * 1.1 / 4 = 0.55;
    # 0 where clipped (t1, t3) and on padding (no nan from the overflowing padded ratio)
    expected = torch.tensor([[0.0, -0.125, 0.0], [0.0, 0.55, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_policy_loss_normalises_by_the_whole_batch_token_count():
    logprobs, old = _logprobs()
    out = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, (0.2, 0.2), normalizer=LossNormalizer("token_mean", 8, 2))
    assert out.loss.item() == pytest.approx(2.1 / 8, abs=1e-6)
    assert out.ppo_ratio.item() == pytest.approx(0.9, abs=1e-6)  # metrics stay this call's means


def test_ratio_metrics_count_a_cut_response_the_loss_leaves_out():
    """#47, item 4: under ppo_loss_mask ended the loss (and the clip fraction) count the ended response only; the
    ratio's means count every response token, the cut one's too, as NeMo-Aligner's actor does."""
    logprobs, old = _logprobs()
    ended = torch.tensor([[1, 1, 0], [0, 0, 0]])  # sample 0 ended; sample 1 was cut at max_new_tokens
    out = ppo_policy_loss(logprobs, old, ADVANTAGES, ended, (0.2, 0.2), metric_mask=MASK)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5) / 2, abs=1e-6)  # t1 and t2 only
    assert out.clip_fraction.item() == pytest.approx(0.5)  # t1 of t1, t2
    assert out.ppo_ratio.item() == pytest.approx(0.9, abs=1e-6)  # (1.5 + 0.5 + 0.5 + 1.1) / 4: both samples
    assert out.ppo_ratio_clamped.item() == pytest.approx(0.975, abs=1e-6)
    only_cut = ppo_policy_loss(logprobs, old, ADVANTAGES, torch.zeros_like(MASK), (0.2, 0.2), metric_mask=MASK)
    assert only_cut.ppo_ratio.item() == pytest.approx(0.9, abs=1e-6)  # no ended response: not 0


def test_policy_loss_entropy_bonus():
    logprobs, old = _logprobs()
    entropies = torch.tensor([[0.4, 0.6, 50.0], [1.0, 2.0, 50.0]])
    out = ppo_policy_loss(logprobs, old, ADVANTAGES, MASK, (0.2, 0.2), entropies=entropies, entropy_bonus=0.1)
    # H = (0.4 + 0.6 + 1.0 + 2.0) / 4 = 1.0; loss = 0.525 - 0.1 * 1.0
    assert out.entropy.item() == pytest.approx(1.0)
    assert out.loss.item() == pytest.approx(0.425, abs=1e-6)


def test_token_entropy():
    logits = torch.tensor([[0.0, 0.0, -100.0, -100.0], [0.0, math.log(3.0), -100.0, -100.0], [1.0, 1.0, 1.0, 1.0]])
    # two equal tokens: ln 2; p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351;
    # uniform over four: ln 4
    entropy = token_entropy(torch.log_softmax(logits, dim=-1))
    assert torch.allclose(entropy, torch.tensor([0.6931472, 0.5623351, 1.3862944]), atol=1e-5)
    assert token_entropy(torch.log_softmax(logits.view(1, 3, 4), dim=-1)).shape == (1, 3)


# value_clip 0.2, four real tokens (V_old, V, R):
#   a: (1.0,  1.5, 2.0): (1.5 - 2)^2 = 0.25; clipped V 1.2: (1.2 - 2)^2 = 0.64 -> 0.64   clipped wins
#   b: (1.0,  1.1, 0.0): 1.21; V inside the range -> 1.21
#   c: (0.0, -0.5, 0.0): 0.25; clipped V -0.2: 0.04 -> 0.25                            (max takes the unclipped)
#   d: (0.0,  0.5, 1.0): 0.25; clipped V 0.2: 0.64 -> 0.64                             clipped wins
# loss = 0.5 * (0.64 + 1.21 + 0.25 + 0.64) / 4 = 0.5 * 2.74 / 4 = 0.3425
OLD_V = torch.tensor([[1.0, 1.0, 5.0], [0.0, 0.0, 5.0]])
V = [[1.5, 1.1, -7.0], [-0.5, 0.5, -7.0]]
RETURNS = torch.tensor([[2.0, 0.0, 9.0], [0.0, 1.0, 9.0]])


def test_critic_loss_with_value_clipping():
    values = torch.tensor(V, requires_grad=True)
    out = critic_loss(values, OLD_V, RETURNS, MASK, value_clip=0.2)
    assert out.loss.item() == pytest.approx(0.3425, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)  # a and d
    out.loss.backward()
    # clipped tokens (a, d) sit outside the clip range: no gradient; b: 0.5 * 2 * (1.1 - 0) / 4 = 0.275;
    # c: (-0.5 - 0) / 4 = -0.125
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.275, 0.0], [-0.125, 0.0, 0.0]]), atol=1e-6)


def test_critic_loss_without_clipping():
    out = critic_loss(torch.tensor(V), OLD_V, RETURNS, MASK, value_clip=0.0)
    # 0.5 * (0.25 + 1.21 + 0.25 + 0.25) / 4 = 0.5 * 1.96 / 4 = 0.245
    assert out.loss.item() == pytest.approx(0.245, abs=1e-6)
    assert out.clip_fraction.item() == 0.0


def test_micro_batches_sum_to_full_batch_gradient():
    torch.manual_seed(0)
    values = torch.randn(4, 5, requires_grad=True)
    old, returns = torch.randn(4, 5), torch.randn(4, 5)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1, 0, 0, 0, 0], [1] * 4 + [0]])
    n = int(mask.sum())
    critic_loss(values, old, returns, mask, 0.2).loss.backward()
    full = values.grad.clone()
    values.grad = None
    for rows in (slice(0, 1), slice(1, 4)):
        critic_loss(values[rows], old[rows], returns[rows], mask[rows], 0.2, num_tokens=n).loss.backward()
    assert torch.allclose(values.grad, full, atol=1e-7)
