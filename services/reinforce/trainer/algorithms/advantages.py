"""The advantage estimators of the REINFORCE path, chosen by `algorithm.advantage_estimator`.

Written to be read top to bottom, like `reinforce.py`. For a prompt g with k sampled responses (rows g*k .. g*k+k-1
of a step's [B, T] tensors, B = num_prompts * k), r_i is the reward model's score, KL_i the sequence KL of
`reinforce.py` (masked mean of the per-token estimate kl_t) and beta the KL penalty:

    rloo                 rewards_with_kl_i = r_i - beta * KL_i
                         A_i  = rewards_with_kl_i - mean of rewards_with_kl_j over the properly-ended j != i
                                (0 when fewer than two samples of the prompt ended)               reinforce.py
    grpo                 A_i  = (rewards_with_kl_i - mean_g) / (std_g + 1e-4)
                                mean and unbiased (Bessel-corrected, / (m-1)) std over the m kept samples of the
                                prompt (a sample whose reward was not finite is dropped from the step: it counts
                                in no statistic, like TRL's nanmean / nanstd)
    dr_grpo              A_i  = rewards_with_kl_i - mean_g                            (no std division)
    reinforce_plus_plus  r_t  = - beta * kl_t + [t = n - 1] * r_i                     (ppo.token_rewards, as PPO)
                         G_t  = sum_{u >= t} r_u                                      (gamma = 1)
                         A_t  = (G_t - mean G) / sqrt(var G + 1e-8)   masked mean and uncorrected variance over
                                every response token of the step's kept samples

rloo, grpo and dr_grpo give one advantage per sample, broadcast to its tokens; reinforce_plus_plus one per token.
`reinforce.token_advantages` picks one; `rloo` itself lives in reinforce.py, next to the loss it was written for.

References:
    rloo                 NeMo-Aligner's REINFORCE (utils/ppo_utils.py calculate_rloo_baseline), with the true mean
                         of the ended others (see reinforce.py for the one deliberate difference)
    grpo                 TRL's GRPOTrainer with scale_rewards="group" (trl/trainer/grpo_trainer.py: nanstd is
                         Bessel-corrected, advantages / (std + 1e-4)); OpenRLHF's group_norm uses the same unbiased
                         torch.std with eps 1e-9. Differences from TRL: the KL penalty is folded into the reward
                         before normalising, as everywhere in this pipeline (TRL adds beta * KL as a loss term; with
                         beta = 0 the two agree); every sample of the group counts, ended or not, as in TRL; a
                         single-sample group gets advantage 0 (TRL: std 0 when num_generations is 1).
    dr_grpo              Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv 2503.20783): GRPO without the
                         std division (and, for the loss, loss_aggregation constant); TRL's scale_rewards="none".
    reinforce_plus_plus  OpenRLHF's REINFORCE++ (openrlhf/models/utils.py compute_reward: -kl_coef * kl per token
                         and the score on the last action token; experience_maker.py get_cumulative_returns;
                         replay_buffer.py normalize: masked mean and uncorrected variance over the whole batch).
                         Differences: the per-token KL is the configured estimator (OpenRLHF: k1 signed by
                         default; here k1 |d| unless use_absolute_kl is off), and the variance gets + 1e-8 as
                         in tensors.masked_whiten where OpenRLHF clamps it at 1e-8 (they differ only for var < ~1e-7).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforce.trainer.algorithms.ppo import token_rewards
from reinforce.trainer.algorithms.tensors import SumOverRanks, local_sum, masked_whiten

GRPO_EPS = 1e-4  # TRL's


def group_deviations(rewards_with_kl: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """(x - mean of the group's kept x, number of kept samples) for groups laid out as [num_prompts, k]; the
    deviation is 0 for a dropped sample (whatever x holds there) and over a group without a kept sample."""
    keep = keep.bool()
    count = keep.sum(dim=-1, keepdim=True).to(rewards_with_kl.dtype)
    mean = torch.where(keep, rewards_with_kl, 0.0).sum(dim=-1, keepdim=True) / count.clamp(min=1)
    return torch.where(keep, rewards_with_kl - mean, 0.0), count


def grpo_advantages(rewards_with_kl: Tensor, keep: Tensor, eps: float = GRPO_EPS) -> Tensor:
    """(x - group mean) / (unbiased group std + eps) over each group's kept samples: [num_prompts, k] -> same.

    A group of identical rewards (std 0) gets advantages 0, not nan; so does a group of one kept sample (whose
    unbiased std would be nan: the squared deviations, all 0, are divided by max(m - 1, 1) instead).
    """
    deviation, count = group_deviations(rewards_with_kl, keep)
    std = (deviation.square().sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return deviation / (std + eps)


def dr_grpo_advantages(rewards_with_kl: Tensor, keep: Tensor) -> Tensor:
    """Dr. GRPO: x - the mean of the group's kept samples, [num_prompts, k] -> same (0 for dropped samples)."""
    return group_deviations(rewards_with_kl, keep)[0]


def reinforce_plus_plus_advantages(
    rewards: Tensor, kl: Tensor, mask: Tensor, kl_penalty: float, all_reduce: SumOverRanks = local_sum
) -> Tensor:
    """A_t of REINFORCE++: scores [B] and per-token KL [B, T] -> whitened returns [B, T], 0 where mask is 0.

    The whitening is over every token of the tensors passed in (and of the other ranks' through all_reduce) that
    the mask keeps: call it on the whole step's batch, with the mask of the kept samples' tokens.
    """
    per_token = token_rewards(rewards, kl, mask, kl_penalty)  # already 0 on padding
    returns = per_token.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{u >= t} r_u, the reverse cumulative sum
    return masked_whiten(returns, mask, all_reduce=all_reduce)
