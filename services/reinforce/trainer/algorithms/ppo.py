"""PPO with a learned critic: GAE, the clipped surrogate objective and a clipped value loss, as NeMo-Aligner does it.

Written to be read top to bottom, like `reinforce.py`. A response y_0..y_{n-1} to a prompt x is sampled by pi_old,
the policy weights that generated the batch (their log-probs are computed once, before the first update on it);
pi_ref is the frozen initial policy and V the critic. s_t is the state before y_t is emitted (x and y_<t), so V(s_t)
sits at the same position as log pi(y_t | s_t) in `response_logprobs`. Tensors are right-padded [B, T], mask 1 on
the n real tokens of each row.

    kl_t      = kl_per_token(log pi_old(y_t), log pi_ref(y_t))      k1 |d_t| by default (tensors.py)
    r_t       = - beta * kl_t  +  [t = n - 1] * RM(x, y)             the score lands on the last real token
    delta_t   = r_t + gamma * V(s_{t+1}) - V(s_t)                     V(s_n) = 0: nothing follows the last token
    A_t       = delta_t + gamma * lambda * A_{t+1}                    A_n = 0                           (GAE)
    R_t       = A_t + V(s_t)                                          the critic's regression target (return)
    Â_t       = (A_t - mean A) / sqrt(var A + 1e-8)                   masked over the batch; var is uncorrected
    rho_t     = pi(y_t) / pi_old(y_t)
    L_clip    = (1/N) sum_t m_t * max(-Â_t * rho_t,  -Â_t * clip(rho_t, 1 - eps_low, 1 + eps_high))
    H         = (1/N) sum_t m_t * H_t,      H_t = - sum_v pi(v | s_t) log pi(v | s_t)
    L_actor   = L_clip - c_H * H                                      entropy bonus c_H
    V^clip_t  = V_old(s_t) + clip(V(s_t) - V_old(s_t), -eps_v, eps_v)  V_old: the critic that valued the rollout
    L_critic  = (1/N) sum_t mask_t * 0.5 * max((V(s_t) - R_t)^2,  (V^clip_t - R_t)^2)

eps_low = eps_high = ratio_eps by default (ratio_eps_low / ratio_eps_high decouple them: DAPO's clip-higher). m_t is
1 on the tokens of the properly-ended responses (`ppo_loss_mask: ended`, NeMo-Aligner's actor since 2024:
masked_mean(max(loss1, loss2), mask * is_end), its entropy over the same mask): a response cut by max_new_tokens adds
no gradient to the actor; `ppo_loss_mask: all` sets m_t = mask_t. The advantages are whitened, and the critic
trained, over every kept response either way, as in NeMo-Aligner.
Asynchronous mode (max_policy_lag > 0): mu, weights up to n versions older than pi_old, sampled the batch (its
log-probs as the generator recorded them). Each L_clip term is then weighted by w_t = min(pi_old(y_t) / mu(y_t), cap),
reinforce.py's truncated importance weight (importance_weight_cap), a constant: pi_old stays the proximal policy the
ratio is clipped around, and w_t moves the expectation from mu to it (decoupled PPO, Hilton et al. 2022). On-policy
w_t is 1 and is not applied.
N is the number of tokens m_t counts in the whole (mini)batch: the losses are masked token means, and passing the
batch's N to each micro-batch makes gradient accumulation add up to exactly the full-batch gradient. L_clip and H
follow `algorithm.loss_aggregation` (token_mean above; aggregation.py); L_critic is always the token mean, and the
critic service computes it (critic/value_model.py critic_loss).

References, NeMo-Aligner (github.com/NVIDIA/NeMo-Aligner):
    r_t               utils/ppo_utils.py calculate_ppo_rewards (the score at index response_length - 2 of its
                      [B, S-1] log-prob layout, which is the last real token) and calculate_kl_penalty (k1, |d|)
    A_t, R_t          utils/ppo_utils.py calculate_advantages_and_returns (values and rewards masked, next value 0
                      after the last position)
    Â_t               utils/distributed.py normalize_tensor / masked_global_mean_var ("the variance here is
                      uncorrected"; rsqrt(var + 1e-8); the mean is not added back)
    L_clip, metrics   models/nlp/gpt/megatron_gpt_ppo_actor.py (ppo_ratio, ppo_ratio_clamped: masked means of rho
                      and of clip(rho)); the clip fraction is TRL's GRPOTrainer clip_ratio/region_mean
    H                 utils/ppo_utils.py calculate_entropy (from the full log-softmax, masked mean)
    L_critic          models/nlp/gpt/megatron_gpt_critic.py (loss_clip_val <= 0 turns the clipping off)
Differences: padded positions of Â are 0 here (NeMo leaves (0 - mean) / std there; the losses mask them either
way), and the per-token KL may be any estimator of tensors.py, not only k1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reinforce.trainer.algorithms.aggregation import LossNormalizer


def token_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, kl_penalty: float) -> Tensor:
    """r_t: the scores [B] and per-token KL [B, T] -> per-token rewards [B, T], 0 on padding.

    An empty response has no token to carry its score, so it contributes nothing; in NeMo-Aligner the score of an
    empty response lands on a masked position, with the same effect.
    """
    mask = mask.bool()
    lengths = mask.sum(-1)
    # the last unmasked position (a multi-turn response's mask has holes where the tools' tokens are)
    last = torch.where(mask, torch.arange(mask.shape[-1], device=mask.device), 0).amax(-1, keepdim=True)
    # torch.where, not a product: padding may hold inf (the log-ratio of garbage), and inf * 0 = nan.
    per_token = torch.where(mask, -kl_penalty * kl, 0.0)
    score = torch.where(lengths > 0, rewards.to(per_token.dtype), 0.0).unsqueeze(-1)
    return per_token.scatter_add(-1, last, score)


def generalized_advantages(
    values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, gae_lambda: float
) -> tuple[Tensor, Tensor]:
    """(A_t, R_t) of right-padded [B, T] values V(s_t) and rewards r_t; both 0 on padding and free of gradient.

    Masking the values makes V(s_n) = 0 for every row, whatever its length: the first padded position (or the end
    of the tensor) stands for the state after the last token.
    """
    mask = mask.bool()
    values = torch.where(mask, values.detach(), 0.0)
    rewards = torch.where(mask, rewards.detach(), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * gae_lambda * running
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, advantages + values


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """The mean over unmasked entries (a metric of this call's tokens)."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / max(int(mask.sum()), 1)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor]:
    """Per token: max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) with clip = (eps_low, eps_high), the clamped
    ratio, and where the clipped term wins (rho > 1 + eps_high with A > 0, or rho < 1 - eps_low with A < 0: those
    tokens get no gradient). All [B, T]; advantages carry no gradient."""
    ratio_clamped = ratio.clamp(1.0 - clip[0], 1.0 + clip[1])
    unclipped = -advantages.detach() * ratio
    clipped = -advantages.detach() * ratio_clamped
    return torch.maximum(unclipped, clipped), ratio_clamped, clipped > unclipped


@dataclass(frozen=True)
class PolicyLoss:
    """L_actor (differentiable) and its metrics, detached: the ratio's means over this call's response tokens
    (`metric_mask`), the clip fraction and entropy over the loss's tokens (`mask`)."""

    loss: Tensor
    ppo_ratio: Tensor  # mean rho (NeMo-Aligner's ppo_ratio)
    ppo_ratio_clamped: Tensor  # mean clip(rho, 1 - eps_low, 1 + eps_high) (NeMo-Aligner's ppo_ratio_clamped)
    clip_fraction: Tensor  # tokens whose clipped term wins the max, so they get no gradient
    entropy: Tensor | None  # H, when token entropies were given


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: tuple[float, float],
    normalizer: LossNormalizer | None = None,
    entropies: Tensor | None = None,
    entropy_bonus: float = 0.0,
    importance_weights: Tensor | None = None,
    metric_mask: Tensor | None = None,
) -> PolicyLoss:
    """The clipped surrogate L_actor. logprobs (differentiable), old_logprobs, advantages (whitened), mask m_t, and
    the optional token entropies H_t: all [B, T]; clip: (eps_low, eps_high). normalizer: the whole minibatch's loss
    aggregation, which L_clip and H in the loss use (None: the masked token mean over this call's tokens).
    importance_weights: asynchronous mode's w_t = min(pi_old / mu, cap) [B, T], a constant each clipped term is
    weighted by (decoupled PPO: pi_old, the weights at the step's start, is the proximal policy; mu sampled).
    metric_mask: the tokens ppo_ratio and ppo_ratio_clamped average over (None: mask). NeMo-Aligner's actor
    averages them over every response token, ended or not, where its loss and entropy count the ended ones only."""
    mask = mask.bool()
    metric_mask = mask if metric_mask is None else metric_mask.bool()
    if normalizer is None:
        normalizer = LossNormalizer("token_mean", int(mask.sum()), mask.shape[0])
    # Padding's log-ratio is set to 0 before exp: exp of garbage may overflow, and its gradient (0 * inf) be nan.
    ratio = torch.exp(torch.where(mask | metric_mask, logprobs - old_logprobs.detach(), 0.0))
    terms, ratio_clamped, clipped = clipped_surrogate(ratio, advantages, clip)
    if importance_weights is not None:
        terms = terms * importance_weights.detach()
    loss = normalizer.reduce(terms, mask)
    entropy = None
    if entropies is not None:
        loss = loss - entropy_bonus * normalizer.reduce(entropies, mask)
        entropy = _token_mean(entropies.detach(), mask)
    return PolicyLoss(
        loss=loss,
        ppo_ratio=_token_mean(ratio.detach(), metric_mask),
        ppo_ratio_clamped=_token_mean(ratio_clamped.detach(), metric_mask),
        # where the clipped term won (TRL's clip_ratio/region_mean)
        clip_fraction=_token_mean(clipped.to(ratio.dtype), mask),
        entropy=entropy,
    )
