"""REINFORCE with a leave-one-out (RLOO) baseline and a KL penalty to the reference policy.

The algorithm of NeMo-Aligner's REINFORCE, written to be read top to bottom. For a prompt x, k responses
y_1..y_k are sampled from the policy pi; the reference pi_ref is the frozen initial policy.

    d_t                = log pi(y_t) - log pi_ref(y_t)                        (response tokens only)
    KL_i               = masked mean over t of  |d_t|  (k1, use_absolute_kl)   or  d_t  (k1)
                                               d_t^2 / 2  (k2)   or   exp(-d_t) - 1 + d_t  (k3)
                         each token's estimate clamped to [-kl_clamp, kl_clamp] (10: OpenRLHF's compute_approx_kl
                         and NeMo-RL's calculate_kl clamp their estimate to [-10, 10]; NeMo-Aligner and TRL do not)
    rewards_with_kl_i  = r_i - beta * KL_i
    b_i                = mean of rewards_with_kl_j over the properly-ended j != i    (M >= 2 ended)
                       = rewards_with_kl_i                                            (M < 2: no signal)
                         (baseline_samples: all counts every scored sample as ended, as TRL's RLOO does)
    A_i                = rewards_with_kl_i - b_i                 (a constant: it carries no gradient)
    loss               = - (1 / N) * sum_i sum_t  mask_it * log pi(y_it) * A_i     (loss_aggregation token_mean)

`algorithm.advantage_estimator` chooses A: rloo (above, the default), grpo (group-normalised), dr_grpo (group mean
only) or reinforce_plus_plus (a per-token A_it, whitened over the step's batch); the others are in advantages.py,
and the loss is the same with A_it in place of A_i. A sample whose reward is not finite is dropped from the step:
it is in no baseline, group statistic or whitening.

`algorithm.policy_loss` clip and gspo replace the loss by a clipped surrogate of an importance ratio to mu, the
policy that sampled (its log-probs as the generator recorded them):

    clip     rho_it = pi(y_it) / mu(y_it)                          PPO's per-token ratio (DAPO: ratio_eps_high > low)
    gspo     rho_it = s_i * pi(y_it) / sg[pi(y_it)],  s_i = exp(masked mean over t of log pi(y_it) - log mu(y_it))
                                                     GSPO's sequence ratio (Zheng et al. 2025, arXiv 2507.18071, its
                                                     "GSPO-token" form: value s_i, gradient s_i * grad log pi(y_it))
    loss     = aggregation over i, t of  max(-A_it * rho_it,  -A_it * clip(rho_it, 1 - eps_low, 1 + eps_high))

On-policy with the torch engine mu = pi up to float noise, so rho = 1 and the gradient is REINFORCE's; the clip acts
on off-policy samples (max_policy_lag > 0) and on an engine's mismatch (the truncated weight is then not applied:
the ratio is the importance weight). GSPO is its paper's objective with loss_aggregation sequence_mean.

Asynchronous mode (max_policy_lag > 0) samples with weights up to n versions old (the behaviour policy mu);
each token's term is then weighted by the truncated importance weight  min(pi(y_t) / mu(y_t), cap),
a constant like A_i, so the gradient estimates the current policy's. A bfloat16 engine (vLLM, TensorRT-LLM)
samples from a slightly different mu even on-policy; `correct_engine_mismatch` (on for those engines) applies the
same weight there (truncated importance sampling, as Yao et al. 2025 propose for vLLM-sampled RL). It costs
nothing but an element-wise ratio; with mu = pi it is 1 and changes nothing.
A group claims the version that sampled it; one claiming an earlier version is checked against that version's
own log-probs, as the current version's groups are against the live weights (earlier_versions_mismatched: the
backend keeps the last max_policy_lag versions' weights), and refused when they are far from them.

N is the number of response tokens in the whole step's batch, so the loss is the masked token mean and
gradient accumulation over micro-batches adds up to exactly the full-batch gradient. `algorithm.loss_aggregation`
also offers the per-sample mean and Dr. GRPO's constant normaliser (aggregation.py).

One deliberate difference from NeMo-Aligner: for a sample that did not end, NeMo-Aligner divides the sum of
the ended others by M - 1 although there are M of them, overstating its baseline; we use the true mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from reinforce.core.packing import MicroBatch, packing_metrics
from reinforce.core.records_pb2 import RolloutGroup
from reinforce.core.registry import AdvantageEstimator
from reinforce.trainer.algorithms.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_plus_plus_advantages,
)
from reinforce.trainer.algorithms.aggregation import LossNormalizer, step_normalizer
from reinforce.trainer.algorithms.base import Algorithm, SampleValues, TokenStats
from reinforce.trainer.algorithms.dapo import shaped_rewards
from reinforce.trainer.algorithms.ppo import clipped_surrogate
from reinforce.trainer.algorithms.tensors import KLEstimator, SumOverRanks, kl_per_token, local_sum, masked_mean
from reinforce.trainer.backends.base import TrainerBackend
from reinforce.trainer.batch import (
    StepBatch,
    generator_logprobs,
    in_order,
    micro_batches,
    token_lists,
)


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
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normalizer: LossNormalizer,
    importance_weights: Tensor | None = None,
) -> Tensor:
    """The REINFORCE loss of a (micro-)batch: the terms -w * log pi * A aggregated by `normalizer` (by default the
    masked token mean over the step: -(1/N) sum mask * w * log pi * A).

    logprobs, mask and importance_weights w (default 1): [B, T]; advantages: [B] (one per sample) or [B, T] (one
    per token). Summing this over micro-batches gives the step's loss, whatever the micro-batch size.
    """
    advantages = advantages.detach()
    per_token = logprobs * (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    return -normalizer.reduce(per_token, mask)


def importance_ratio(logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """rho_it of policy_loss clip (level "clip": pi / mu per token) or gspo (the sequence ratio s_i on each of its
    tokens, with the gradient of s_i * log pi(y_it)). logprobs differentiable; [B, T] each; 1 on padding for clip."""
    mask = mask.bool()
    # padding's log-ratio is 0 before exp: exp of garbage may overflow, and its gradient (0 * inf) be nan
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs, 0.0)
    if level == "clip":
        return torch.exp(log_ratio)
    sequence = masked_mean(log_ratio.detach(), mask).unsqueeze(-1)
    return torch.exp(sequence + torch.where(mask, logprobs - logprobs.detach(), 0.0))


def mismatched_groups(
    behaviour: Tensor, logprobs: Tensor, mask: Tensor, same_version: Tensor, k: int, limit: float
) -> Tensor:
    """[G] bool: groups sampled by the version being trained whose mean |mu - pi| over a sample's tokens exceeds
    `limit` for any sample. Same weights give the same log-probs up to float noise, so such a group was sampled by
    other weights (a forged or corrupted version) and must not be trained on. A NaN gap counts as too far."""
    gap = masked_mean((behaviour - logprobs.detach()).abs(), mask)  # [B]
    return (~(gap.view(-1, k) <= limit)).any(-1) & same_version.view(-1, k).all(-1)


def earlier_versions_mismatched(
    groups: list[RolloutGroup], backend: TrainerBackend, version: int, limit: float, temperature: float
) -> Tensor:
    """[G] bool: groups sampled by an earlier version than `version` (max_policy_lag > 0) whose log-probs are far
    from that version's own (`mismatched_groups` against the weights the backend kept of it: `keep_version`), or
    claim a version this process never kept (it started since): a group can claim any version the trainer
    accepts, so each is checked against the weights it names, or refused."""
    refused = torch.zeros(len(groups), dtype=torch.bool)
    for index, group in enumerate(groups):
        if group.policy_version == version:
            continue  # checked against the live weights, in the update's own pass
        prompt_ids, response_ids = token_lists([group])
        earlier = backend.version_logprobs(group.policy_version, prompt_ids, response_ids, temperature)
        if earlier is None:
            refused[index] = True
            continue
        logprobs, mask = earlier
        k = len(group.samples)
        behaviour = generator_logprobs([group], like=logprobs)
        refused[index] = mismatched_groups(behaviour, logprobs, mask, torch.ones(k, dtype=torch.bool), k, limit)[0]
    return refused


class BehaviourStats:
    """The behaviour policy mu (the generator's log-probs) beside the trainer's pi, accumulated over a step's
    micro-batches: the train/inference gap where the generator had the very weights being trained, the groups
    refused for it, and the importance weights. REINFORCE and PPO report the same five figures from it."""

    def __init__(self, k: int, limit: float, cap: float) -> None:
        self.k, self.limit, self.cap = k, limit, cap
        self.mismatch, self.weights, self.refused_groups = TokenStats(), TokenStats(), 0

    def compare(
        self, groups: list[RolloutGroup], logprobs: Tensor, mask: Tensor, version: int, earlier_refused: Tensor
    ) -> tuple[Tensor, Tensor]:
        """mu of `groups` shaped like `logprobs`, and [G] bool of the groups refused: too far from the live weights
        (`mismatched_groups`) or from the earlier version they claim (`earlier_refused`)."""
        behaviour = generator_logprobs(groups, like=logprobs)
        same_version = torch.tensor([g.policy_version == version for g in groups for _ in g.samples])
        self.mismatch.add((behaviour - logprobs.detach()).abs(), mask * same_version.unsqueeze(-1))
        refused = mismatched_groups(behaviour, logprobs, mask, same_version, self.k, self.limit) | earlier_refused
        self.refused_groups += int(refused.sum())
        return behaviour, refused

    def metrics(self) -> dict[str, float]:
        return {
            "train_rollouts/logprob_mismatch": self.mismatch.mean(),
            "train_rollouts/refused_mismatched_groups": float(self.refused_groups),
            "train_rollouts/importance_weight_mean": self.weights.mean(),
            "train_rollouts/importance_weight_max": self.weights.max,
            "train_rollouts/importance_weight_capped_fraction": self.weights.fraction_at_least(self.cap),
        }


@dataclass(frozen=True)
class TokenAdvantages:
    """What the loss needs from any estimator: per-token advantages and, for the metrics, each sample's KL."""

    kl: Tensor  # [B] KL_i, the masked mean of the per-token estimate
    advantages: Tensor  # [B, T], 0 on padding, no gradient


@dataclass(frozen=True)
class KLPenalty:
    """How the reward is penalised for the distance to the reference: beta and the per-token estimate."""

    beta: float
    estimator: KLEstimator = "k1"
    use_absolute_kl: bool = True
    clamp: float | None = None

    def per_token(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        return kl_per_token(logprobs, ref_logprobs, self.estimator, self.use_absolute_kl, self.clamp)


def token_advantages(
    estimator: AdvantageEstimator,
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    is_end: Tensor,
    keep: Tensor,
    penalty: KLPenalty,
    all_reduce: SumOverRanks = local_sum,
) -> TokenAdvantages:
    """Advantages of one step's batch. rewards, is_end (rloo's baseline members), keep (the samples trained on):
    [num_prompts, k]; logprobs (of the sampling policy, no gradient needed), ref_logprobs, mask: [B, T] with
    B = num_prompts * k, the samples of a prompt adjacent. Dropped samples (keep False) count in no statistic.
    all_reduce (reinforce_plus_plus): the sum over data-parallel ranks of the whitening's statistics."""
    logprobs, mask = logprobs.detach(), mask.bool()
    kl_tokens = penalty.per_token(logprobs, ref_logprobs)
    kl = masked_mean(kl_tokens, mask)
    if estimator == "reinforce_plus_plus":
        kept_tokens = mask & keep.reshape(-1, 1)
        whitened = reinforce_plus_plus_advantages(rewards.reshape(-1), kl_tokens, kept_tokens, penalty.beta, all_reduce)
        return TokenAdvantages(kl, whitened)
    rewards_with_kl = rewards - penalty.beta * kl.view(rewards.shape)
    if estimator == "rloo":
        per_sample = rloo_advantages(rewards, kl.view(rewards.shape), is_end, penalty.beta).advantages
    elif estimator == "grpo":
        per_sample = grpo_advantages(rewards_with_kl, keep)
    elif estimator == "dr_grpo":
        per_sample = dr_grpo_advantages(rewards_with_kl, keep)
    else:
        raise ValueError(
            f"unknown advantage_estimator {estimator!r} (expected rloo, grpo, dr_grpo or reinforce_plus_plus)"
        )
    advantages = torch.where(mask, per_sample.reshape(-1, 1).to(logprobs.dtype), 0.0)
    return TokenAdvantages(kl, advantages.detach())


class Reinforce(Algorithm):
    """One pass over the step's groups, micro-batched by token budget in whole groups (the group estimators need
    them, and a group sampled by other weights is refused whole).

    reinforce_plus_plus whitens over the whole step's batch, which no micro-batch sees: a first pass without
    gradient, packed by sequence, computes its advantages from the step's log-probs (the weights do not change
    before the step's one optimizer step), then the optimisation pass uses them.
    """

    name = "reinforce"

    def update(self, batch: StepBatch, backend: TrainerBackend, version: int) -> dict[str, float]:
        alg, t, temperature = self.spec.algorithm, self.spec.training, self.spec.generation.temperature
        train_start = time.perf_counter()
        whole_batch, ref_seconds = None, 0.0
        rewards = shaped_rewards(batch, self.spec)
        if alg.advantage_estimator == "reinforce_plus_plus":
            whole_batch, ref_seconds = self.whole_batch_advantages(batch, rewards, backend)
        backend.zero_grad()
        # N and S of every rank's batch
        normalizer = step_normalizer(self.spec, self.ranks.sum(batch.num_tokens), self.ranks.sum(batch.num_samples))
        loss_total, advantages_abs, clipped = 0.0, TokenStats(), TokenStats()
        k = alg.num_rollouts_per_prompt
        kl, advantage_means = torch.zeros(batch.keep.numel()), torch.zeros(batch.keep.numel())
        limit = t.max_logprob_mismatch
        behaviour_stats = BehaviourStats(k, limit, alg.importance_weight_cap)
        earlier_refused = earlier_versions_mismatched(batch.groups, backend, version, limit, temperature)
        parts = micro_batches(
            *token_lists(batch.groups), t, k, whole_groups=True, shares_prompts=backend.shares_prompts
        )
        for part in parts:
            rows = part.groups(k)
            logprobs, mask, adv, seconds = self.part_advantages(batch, part, rewards, whole_batch, backend)
            ref_seconds += seconds
            groups = [batch.groups[i] for i in rows.tolist()]
            behaviour, refused = behaviour_stats.compare(groups, logprobs, mask, version, earlier_refused[rows])
            loss_mask = mask * (batch.keep[rows] & ~refused.unsqueeze(-1)).reshape(-1, 1)
            weights = behaviour_stats.weights
            loss = self.loss(logprobs, behaviour, adv.advantages, loss_mask, normalizer, weights, clipped)
            loss.backward()
            loss_total += loss.item()
            advantages_abs.add(adv.advantages.abs(), loss_mask)
            kl[part.rows] = adv.kl
            advantage_means[part.rows] = masked_mean(adv.advantages, mask)
        grad_norm, lr = backend.optimizer_step()
        keep = batch.keep.reshape(-1)
        self.sample_values = SampleValues(kl, advantage_means)
        rewards_with_kl = rewards.reshape(-1) - alg.initial_policy_kl_penalty * kl
        return {
            "train_rollouts/init_policy_kl": kl[keep].mean().item(),
            "train_rollouts/rewards_with_kl": rewards_with_kl[keep].mean().item(),
            "train_rollouts/overlong_penalty": (rewards - batch.rewards)[batch.keep].mean().item(),
            "train_optim/ppo_clip_fraction": clipped.mean(),
            "train_rollouts/advantages_abs": advantages_abs.mean(),
            **behaviour_stats.metrics(),
            "train_optim/loss": loss_total,
            "train_optim/grad_norm": grad_norm,
            "train_optim/lr": lr,
            "timers/init_logprobs": ref_seconds,
            "timers/train_time": time.perf_counter() - train_start - ref_seconds,
            **packing_metrics(parts),
        }

    def part_advantages(
        self,
        batch: StepBatch,
        part: MicroBatch,
        rewards: Tensor,
        whole_batch: TokenAdvantages | None,
        backend: TrainerBackend,
    ) -> tuple[Tensor, Tensor, TokenAdvantages, float]:
        """A micro-batch's policy log-probs (with gradient) and their mask, its advantages, and the seconds its
        reference log-probs took (none when `whole_batch` holds the step's advantages already)."""
        temperature = self.spec.generation.temperature
        if whole_batch is not None:
            logprobs, mask = backend.policy_logprobs(part.prompt_ids, part.response_ids, temperature)
            adv = TokenAdvantages(whole_batch.kl[part.rows], whole_batch.advantages[part.rows, : mask.shape[1]])
            return logprobs, mask, adv, 0.0
        rows = part.groups(self.spec.algorithm.num_rollouts_per_prompt)
        ref_start = time.perf_counter()
        ref_logprobs = backend.reference_logprobs(part.prompt_ids, part.response_ids, temperature)
        ref_seconds = time.perf_counter() - ref_start
        logprobs, mask = backend.policy_logprobs(part.prompt_ids, part.response_ids, temperature)
        members, keep = self.baseline_members(batch)[rows], batch.keep[rows]
        return logprobs, mask, self.advantages(rewards[rows], logprobs, ref_logprobs, mask, members, keep), ref_seconds

    def loss(
        self,
        logprobs: Tensor,
        behaviour: Tensor,
        advantages: Tensor,
        mask: Tensor,
        normalizer: LossNormalizer,
        weights: TokenStats,
        clipped: TokenStats,
    ) -> Tensor:
        """A micro-batch's share of the step's loss (policy_loss), adding to the importance weights' and the clip's
        statistics."""
        alg = self.spec.algorithm
        if alg.policy_loss != "reinforce":
            ratio = importance_ratio(logprobs, behaviour, mask, alg.policy_loss)
            terms, _, was_clipped = clipped_surrogate(ratio, advantages, alg.clip_range())
            clipped.add(was_clipped.to(logprobs.dtype), mask)
            weights.add(ratio, mask)
            return normalizer.reduce(terms, mask)
        rho = None
        if alg.max_policy_lag > 0 or self.spec.corrects_engine_mismatch():
            rho = truncated_importance_weights(logprobs, behaviour, alg.importance_weight_cap)
            weights.add(rho, mask)
        return policy_gradient_loss(logprobs, advantages, mask, normalizer, rho)

    def baseline_members(self, batch: StepBatch) -> Tensor:
        """The samples RLOO's baseline averages over: the properly ended ones (NeMo-Aligner) or every scored one
        (`baseline_samples: all`, TRL), so that responses cut by max_new_tokens still carry a signal."""
        return batch.is_end if self.spec.algorithm.baseline_samples == "ended" else batch.keep

    def advantages(
        self, rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, is_end: Tensor, keep: Tensor
    ) -> TokenAdvantages:
        alg = self.spec.algorithm
        penalty = KLPenalty(alg.initial_policy_kl_penalty, alg.kl_estimator, alg.use_absolute_kl, alg.kl_clamp)
        return token_advantages(
            alg.advantage_estimator, rewards, logprobs, ref_logprobs, mask, is_end, keep, penalty,
            self.ranks.sum_tensor,
        )  # fmt: skip

    @torch.no_grad()
    def whole_batch_advantages(
        self, batch: StepBatch, rewards: Tensor, backend: TrainerBackend
    ) -> tuple[TokenAdvantages, float]:
        """The advantages of every sample of the step ([B, T] over the whole batch), and the reference's seconds."""
        temperature, k = self.spec.generation.temperature, self.spec.algorithm.num_rollouts_per_prompt
        logprobs, ref_logprobs, masks, ref_seconds = [], [], [], 0.0
        parts = micro_batches(
            *token_lists(batch.groups), self.spec.training, k, whole_groups=False, shares_prompts=backend.shares_prompts
        )
        for part in parts:
            ref_start = time.perf_counter()
            ref_logprobs.append(backend.reference_logprobs(part.prompt_ids, part.response_ids, temperature))
            ref_seconds += time.perf_counter() - ref_start
            current, mask = backend.policy_logprobs(part.prompt_ids, part.response_ids, temperature)
            logprobs.append(current)
            masks.append(mask)
        advantages = self.advantages(
            rewards,
            in_order(logprobs, parts),
            in_order(ref_logprobs, parts),
            in_order(masks, parts),
            self.baseline_members(batch),
            batch.keep,
        )
        return advantages, ref_seconds
