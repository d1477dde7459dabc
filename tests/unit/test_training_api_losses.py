"""The training API's losses against hand-computed values: per-token sums with the client's inputs, no
normalisation (services/reinforce/training_api/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from reinforce.training_api.losses import LOSSES, cross_entropy, importance_sampling


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


def test_each_loss_names_what_it_reads():
    assert {name: needed for name, (_, needed) in LOSSES.items()} == {
        "cross_entropy": ("weights",),
        "importance_sampling": ("logprobs", "advantages"),
    }
