"""REINFORCE with a leave-one-out (RLOO) baseline and a KL penalty to the reference policy.

The algorithm of NeMo-Aligner's REINFORCE, written to be read top to bottom. For a prompt x, k responses
y_1..y_k are sampled from the policy pi; the reference pi_ref is the frozen initial policy.

    d_t                = log pi(y_t) - log pi_ref(y_t)                        (response tokens only)
    KL_i               = masked mean over t of  |d_t|  (k1, use_absolute_kl)   or  d_t  (k1)
                                               d_t^2 / 2  (k2)   or   exp(-d_t) - 1 + d_t  (k3)
    rewards_with_kl_i  = r_i - beta * KL_i
    b_i                = mean of rewards_with_kl_j over the properly-ended j != i    (M >= 2 ended)
                       = rewards_with_kl_i                                            (M < 2: no signal)
    A_i                = rewards_with_kl_i - b_i                 (a constant: it carries no gradient)
    loss               = - (1 / N) * sum_i sum_t  mask_it * log pi(y_it) * A_i

Asynchronous mode (max_policy_lag > 0) samples with weights up to n versions old (the behaviour policy mu);
each token's term is then weighted by the truncated importance weight  min(pi(y_t) / mu(y_t), cap),
a constant like A_i, so the gradient estimates the current policy's.

N is the number of response tokens in the whole step's batch, so the loss is the masked token mean and
gradient accumulation over micro-batches adds up to exactly the full-batch gradient.

One deliberate difference from NeMo-Aligner: for a sample that did not end, NeMo-Aligner divides the sum of
the ended others by M - 1 although there are M of them, overstating its baseline; we use the true mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from reinforce.trainer.algorithms.base import Algorithm, TokenStats
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import StepBatch, generator_logprobs, token_lists

KLEstimator = Literal["k1", "k2", "k3"]


def masked_mean(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Mean of `values` where mask is 1; 0 where a row has no unmasked entry (an empty response).

    Padded positions are replaced, not multiplied by 0: padding may hold inf (exp of garbage), and inf * 0 = nan.
    """
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum(dim) / mask.sum(dim).clamp(min=1).to(values.dtype)


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator, use_absolute_kl: bool) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from d_t = log pi(y_t) - log pi_ref(y_t), y_t ~ pi."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d.abs() if use_absolute_kl else d
    if estimator == "k2":
        return d.square() / 2
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown kl_estimator {estimator!r} (expected k1, k2 or k3)")


def sequence_kl(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator, use_absolute_kl: bool
) -> Tensor:
    """KL_i: the masked mean over each response's tokens. Shapes [B, T] -> [B]."""
    return masked_mean(kl_per_token(logprobs, ref_logprobs, estimator, use_absolute_kl), mask)


def rloo_baseline(rewards_with_kl: Tensor, is_end: Tensor) -> Tensor:
    """b_i for groups laid out as [num_prompts, k]: the mean over the *other properly-ended* samples.

    A prompt with fewer than two ended samples has no trustworthy baseline, so b_i = rewards_with_kl_i and its
    advantages are zero. Samples that did not end still get a baseline (the mean of all ended ones).
    """
    ended = is_end.to(rewards_with_kl.dtype)
    num_ended = ended.sum(dim=-1, keepdim=True)  # M per prompt
    others_sum = (rewards_with_kl * ended).sum(dim=-1, keepdim=True) - rewards_with_kl * ended
    others_count = num_ended - ended  # M - 1 for an ended i, M for an unended i
    baseline = others_sum / others_count.clamp(min=1.0)
    return torch.where(num_ended >= 2, baseline, rewards_with_kl)


@dataclass(frozen=True)
class Advantages:
    """Per-sample quantities of one step, each [num_prompts, k]."""

    kl: Tensor
    rewards_with_kl: Tensor
    baseline: Tensor
    advantages: Tensor


def rloo_advantages(rewards: Tensor, kl: Tensor, is_end: Tensor, kl_penalty: float) -> Advantages:
    """rewards, kl, is_end: [num_prompts, k]; kl_penalty is beta (initial_policy_kl_penalty)."""
    rewards_with_kl = rewards - kl_penalty * kl
    baseline = rloo_baseline(rewards_with_kl, is_end)
    return Advantages(kl, rewards_with_kl, baseline, (rewards_with_kl - baseline).detach())


def truncated_importance_weights(logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """min(pi / mu, cap) per token, from log-probs [B, T]; a constant (no gradient)."""
    return torch.exp(logprobs.detach() - behaviour_logprobs).clamp(max=cap)


def policy_gradient_loss(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, num_tokens: int, importance_weights: Tensor | None = None
) -> Tensor:
    """The REINFORCE loss of a (micro-)batch: -(1/N) sum mask * w * log pi * A, with N the step's token count.

    logprobs, mask and importance_weights w (default 1): [B, T]; advantages: [B]. Summing this over
    micro-batches gives the step's masked token mean, whatever the micro-batch size.
    """
    per_token = logprobs * advantages.detach().unsqueeze(-1)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    return -torch.where(mask.bool(), per_token, 0.0).sum() / max(num_tokens, 1)


def mismatched_groups(
    behaviour: Tensor, logprobs: Tensor, mask: Tensor, same_version: Tensor, k: int, limit: float
) -> Tensor:
    """[G] bool: groups sampled by the version being trained whose mean |mu - pi| over a sample's tokens exceeds
    `limit` for any sample. Same weights give the same log-probs up to float noise, so such a group was sampled by
    other weights (a forged or corrupted version) and must not be trained on."""
    gap = masked_mean((behaviour - logprobs.detach()).abs(), mask)  # [B]
    return (gap.view(-1, k) > limit).any(-1) & same_version.view(-1, k).all(-1)


class Reinforce(Algorithm):
    """One pass over the step's groups, micro-batched by whole groups (RLOO needs them): the formulas above."""

    name = "reinforce"

    def update(self, batch: StepBatch, backend: TrainerBackend, version: int) -> dict[str, float]:
        alg, t = self.spec.algorithm, self.spec.training
        temperature = self.spec.generation.temperature
        backend.zero_grad()
        num_tokens = self.ranks.sum(batch.num_tokens)  # N: the token count of every rank's batch
        kl_all, rwk_all, adv_all = [], [], []
        loss_total, ref_seconds, refused_groups = 0.0, 0.0, 0
        mismatch, weights = TokenStats(), TokenStats()
        train_start = time.perf_counter()
        for start in range(0, len(batch.groups), t.micro_batch_prompts):
            rows = slice(start, start + t.micro_batch_prompts)
            groups = batch.groups[rows]
            prompt_ids, response_ids = token_lists(groups)
            ref_start = time.perf_counter()
            ref_logprobs = backend.reference_logprobs(prompt_ids, response_ids, temperature)
            ref_seconds += time.perf_counter() - ref_start
            logprobs, mask = backend.policy_logprobs(prompt_ids, response_ids, temperature)
            kl = sequence_kl(logprobs.detach(), ref_logprobs, mask, alg.kl_estimator, alg.use_absolute_kl)
            rewards = batch.rewards[rows]
            adv = rloo_advantages(rewards, kl.view(rewards.shape), batch.is_end[rows], alg.initial_policy_kl_penalty)
            behaviour = generator_logprobs(groups, like=logprobs)
            same_version = torch.tensor([g.policy_version == version for g in groups for _ in g.samples])
            refused = mismatched_groups(
                behaviour, logprobs, mask, same_version, rewards.shape[1], t.max_logprob_mismatch
            )
            refused_groups += int(refused.sum())
            kept = batch.keep[rows] & ~refused.unsqueeze(-1)
            loss_mask = mask * kept.reshape(-1, 1)
            rho = None
            if alg.max_policy_lag > 0:
                rho = truncated_importance_weights(logprobs, behaviour, alg.importance_weight_cap)
                weights.add(rho, loss_mask)
            loss = policy_gradient_loss(logprobs, adv.advantages.reshape(-1), loss_mask, num_tokens, rho)
            loss.backward()
            loss_total += loss.item()
            # train/inference mismatch: only where the generator had the very weights being trained
            mismatch.add((behaviour - logprobs.detach()).abs(), mask * same_version.unsqueeze(-1))
            kl_all.append(adv.kl)
            rwk_all.append(adv.rewards_with_kl)
            adv_all.append(adv.advantages)
        grad_norm, lr = backend.optimizer_step()
        keep = batch.keep
        return {
            "train_rollouts/init_policy_kl": torch.cat(kl_all)[keep].mean().item(),
            "train_rollouts/rewards_with_kl": torch.cat(rwk_all)[keep].mean().item(),
            "train_rollouts/advantages_abs": torch.cat(adv_all)[keep].abs().mean().item(),
            "train_rollouts/logprob_mismatch": mismatch.mean(),
            "train_rollouts/refused_mismatched_groups": float(refused_groups),
            "train_rollouts/importance_weight_mean": weights.mean(),
            "train_rollouts/importance_weight_max": weights.max,
            "train_rollouts/importance_weight_capped_fraction": weights.fraction_at_least(alg.importance_weight_cap),
            "train_optim/loss": loss_total,
            "train_optim/grad_norm": grad_norm,
            "train_optim/lr": lr,
            "timers/init_logprobs": ref_seconds,
            "timers/train_time": time.perf_counter() - train_start - ref_seconds,
        }
