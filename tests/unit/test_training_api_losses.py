"""The training API's losses against hand-computed values: per-token sums with the client's inputs, no
normalisation (services/reinforce/training_api/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from reinforce.training_api.losses import LOSSES, cispo, config_of, cross_entropy, dro, gspo, importance_sampling, ppo


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs():
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    weights = torch.tensor([1.0, 0.0, 2.0])
    # -(1 * -1 + 0 * -2 + 2 * -0.5) = 2: neither divided by the 3 tokens nor by the weights' sum (3)
    assert cross_entropy(logprobs, {"weights": weights}).item() == pytest.approx(2.0, abs=1e-6)


def test_importance_sampling_weights_each_advantage_by_the_probability_ratio():
    target = torch.tensor([-1.0, -2.0, -3.0])
    sampler = torch.tensor([-1.5, -2.0, -1.0])
    advantages = torch.tensor([2.0, -1.0, 0.0])
    # -(exp(0.5) * 2 + exp(0) * -1 + exp(-2) * 0) = 1 - 2 e^0.5
    expected = 1.0 - 2.0 * math.exp(0.5)
    got = importance_sampling(target, {"logprobs": sampler, "advantages": advantages}).item()
    assert got == pytest.approx(expected, abs=1e-6)


def test_importance_sampling_on_policy_has_the_reinforce_gradient():
    """With the sampler's log-probs equal to the learner's, d loss / d logprob_t = -advantage_t."""
    target = torch.tensor([-0.7, -1.3], requires_grad=True)
    advantages = torch.tensor([0.5, -2.0])
    importance_sampling(target, {"logprobs": target.detach(), "advantages": advantages}).backward()
    assert torch.allclose(target.grad, -advantages)


def clip(low: float, high: float, n: int) -> dict[str, torch.Tensor]:
    """loss_fn_config's thresholds as the server hands them to a loss: the value at every token."""
    return {"clip_low_threshold": torch.full((n,), low), "clip_high_threshold": torch.full((n,), high)}


# Four tokens, one per case of PPO's clip at the default thresholds [0.8, 1.2]:
#   t0 r = e^0.5 = 1.649 > 1.2, A = +1: min(1.649, 1.2) = 1.2, clipped (no gradient)
#   t1 r = e^0 = 1, A = -1: -1 either way
#   t2 r = e^0.5, A = -2: min(-2 e^0.5, -2.4) = -2 e^0.5, the unclipped one (below the clipped)
#   t3 r = e^-0.5 = 0.607 < 0.8, A = +2: min(2 e^-0.5, 1.6) = 2 e^-0.5, the unclipped one
TARGET = [-1.0, -2.0, -0.5, -1.5]
SAMPLER = [-1.5, -2.0, -1.0, -1.0]
ADVANTAGES = [1.0, -1.0, -2.0, 2.0]


def rl_inputs(low: float = 0.8, high: float = 1.2) -> dict[str, torch.Tensor]:
    return {"logprobs": torch.tensor(SAMPLER), "advantages": torch.tensor(ADVANTAGES), **clip(low, high, 4)}


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_objectives():
    target = torch.tensor(TARGET, requires_grad=True)
    loss = ppo(target, rl_inputs())
    e = math.exp(0.5)
    # -(1.2 - 1 - 2 e^0.5 + 2 / e^0.5), summed, not averaged over the 4 tokens
    assert loss.item() == pytest.approx(-(1.2 - 1.0 - 2 * e + 2 / e), abs=1e-5)
    loss.backward()
    # d/d lp_t of -(r_t A_t) is -r_t A_t where unclipped; 0 where the clip won (t0)
    assert target.grad.tolist() == pytest.approx([0.0, 1.0, 2 * e, -2 / e], abs=1e-5)


def test_ppo_reads_its_thresholds():
    # wide enough that nothing clips: plain importance sampling, -(e^0.5 - 1 - 2 e^0.5 + 2 e^-0.5)
    e = math.exp(0.5)
    got = ppo(torch.tensor(TARGET), rl_inputs(0.5, 2.0)).item()
    assert got == pytest.approx(-(e - 1.0 - 2 * e + 2 / e), abs=1e-5)


def test_cispo_weighs_the_log_probability_by_the_clipped_ratio_without_its_gradient():
    target = torch.tensor(TARGET, requires_grad=True)
    loss = cispo(target, rl_inputs())
    # clipped ratios [1.2, 1, 1.2, 0.8] (e^0.5 -> 1.2, e^-0.5 -> 0.8); objective sum c lp A =
    # 1.2*-1*1 + 1*-2*-1 + 1.2*-0.5*-2 + 0.8*-1.5*2 = -1.2 + 2 + 1.2 - 2.4 = -0.4
    assert loss.item() == pytest.approx(0.4, abs=1e-5)
    loss.backward()
    # d/d lp_t = -c_t A_t: the ratio is a constant, even where it clips
    assert target.grad.tolist() == pytest.approx([-1.2, 1.0, 2.4, -1.6], abs=1e-5)


def test_dro_is_the_advantage_term_less_half_beta_times_the_squared_log_ratio():
    target = torch.tensor([-1.0, -2.0], requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([-1.5, -1.0]),
        "advantages": torch.tensor([1.0, -2.0]),
        "beta": torch.full((2,), 0.1),
    }
    loss = dro(target, inputs)
    # t0: -1*1 - 0.05*0.5^2 = -1.0125; t1: -2*-2 - 0.05*(-1)^2 = 3.95; loss = -(2.9375)
    assert loss.item() == pytest.approx(-2.9375, abs=1e-6)
    loss.backward()
    # d/d lp_t = -(A_t - beta (lp_t - q_t)): -(1 - 0.1*0.5) = -0.95, -(-2 - 0.1*-1) = 1.9
    assert target.grad.tolist() == pytest.approx([-0.95, 1.9], abs=1e-6)


# GSPO: log-ratios [0.2, 0, 5]; the mask leaves the third out of the mean, so s = e^((0.2 + 0) / 2) = e^0.1
GSPO_TARGET = [-1.0, -2.0, -0.5]


def gspo_inputs(low: float = 0.8, high: float = 1.2) -> dict[str, torch.Tensor]:
    return {
        "logprobs": torch.tensor([-1.2, -2.0, -5.5]),
        "advantages": torch.tensor([1.0, -1.0, 2.0]),
        "sequence_ratio_mask": torch.tensor([1.0, 1.0, 0.0]),
        **clip(low, high, 3),
    }


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    target = torch.tensor(GSPO_TARGET, requires_grad=True)
    loss = gspo(target, gspo_inputs())
    s = math.exp(0.1)  # 1.105, inside [0.8, 1.2]: nothing clips
    # every token, the unmasked third too, carries s: -(s*1 + s*-1 + s*2) = -2 s
    assert loss.item() == pytest.approx(-2 * s, abs=1e-5)
    loss.backward()
    # s_t = sg[s] * p_t / sg[p_t]: d s_t / d lp_t = s, so d loss / d lp_t = -s A_t
    assert target.grad.tolist() == pytest.approx([-s, s, -2 * s], abs=1e-5)


def test_gspo_clips_the_sequence_ratio():
    target = torch.tensor(GSPO_TARGET, requires_grad=True)
    loss = gspo(target, gspo_inputs(high=1.05))
    s = math.exp(0.1)
    # t0 A=1: min(s, 1.05) = 1.05; t1 A=-1: min(-s, -1.05) = -s; t2 A=2: min(2s, 2.1) = 2.1
    assert loss.item() == pytest.approx(-(1.05 - s + 2.1), abs=1e-5)
    loss.backward()
    assert target.grad.tolist() == pytest.approx([0.0, s, 0.0], abs=1e-5)


def test_gspo_refuses_a_datum_with_no_token_in_its_ratio():
    inputs = {**gspo_inputs(), "sequence_ratio_mask": torch.zeros(3)}
    with pytest.raises(ValueError, match="sequence_ratio_mask marks no token"):
        gspo(torch.tensor(GSPO_TARGET), inputs)


def test_each_loss_names_what_it_reads():
    assert {name: needed for name, (_, needed) in LOSSES.items()} == {
        "cross_entropy": ("weights",),
        "importance_sampling": ("logprobs", "advantages"),
        "ppo": ("logprobs", "advantages"),
        "cispo": ("logprobs", "advantages"),
        "dro": ("logprobs", "advantages"),
        "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    }


def test_the_config_defaults_are_the_sdk_docs_thresholds():
    for loss_fn in ("ppo", "cispo", "gspo"):
        assert config_of(loss_fn, {}) == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert config_of("ppo", {"clip_low_threshold": 0.9}) == pytest.approx(
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.2}
    )
    assert config_of("dro", {"beta": 0.05}) == {"beta": 0.05}
    assert config_of("cross_entropy", {}) == {}
