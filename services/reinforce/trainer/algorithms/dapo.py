"""DAPO's additions to GRPO (Yu et al. 2025, arXiv 2503.14476) that are not a loss setting of their own.

    overlong shaping   R_length(y) = 0                                       |y| <= L - C
                                   = -p * (|y| - (L - C)) / C               L - C < |y| <= L
                       with L = generation.max_new_tokens, C = algorithm.overlong_buffer, p = overlong_penalty (DAPO:
                       p = 1; veRL's overlong_buffer.penalty_factor), added to the reward model's score before the
                       advantages (a response cannot be longer than L here, so DAPO's -1 beyond L never applies)
    dynamic sampling   a group whose samples' rewards are all equal gives every sample advantage 0 under grpo and
                       dr_grpo (and only the KL term under rloo): it is filtered out of the step and its prompt
                       replaced by a new one (feed.py, collect.py), until the step has prompts_per_step groups

The rest of DAPO is settings: clip-higher is `ratio_eps_low` / `ratio_eps_high` with `policy_loss: clip`, the
token-level loss is `loss_aggregation: token_mean`, and the KL penalty is off (`initial_policy_kl_penalty: 0`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reinforce.core.records_pb2 import RolloutGroup
from reinforce.core.spec import RunSpec
from reinforce.trainer.batch import StepBatch


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """R_length of responses of `lengths` tokens (any shape): 0 up to max_new_tokens - buffer, then linear down to
    -penalty at max_new_tokens."""
    excess = (lengths - (max_new_tokens - buffer)).clamp(min=0).to(torch.float32)
    return -penalty * (excess / buffer).clamp(max=1.0)


def shaped_rewards(batch: StepBatch, spec: RunSpec) -> Tensor:
    """The rewards the algorithm trains on, [G, k]: the reward model's, plus R_length with `overlong_buffer` set."""
    alg = spec.algorithm
    if alg.overlong_buffer is None:
        return batch.rewards
    shaping = overlong_penalty(batch.lengths, spec.generation.max_new_tokens, alg.overlong_buffer, alg.overlong_penalty)
    return batch.rewards + torch.where(batch.keep, shaping, 0.0)


def uninformative(group: RolloutGroup) -> bool:
    """Every sample of the group has the same reward: no sample does better than another.

    Non-finite rewards are left out (those samples are dropped from the step); fewer than two finite ones are
    uninformative too."""
    rewards = [s.reward for s in group.samples if math.isfinite(s.reward)]
    return len(rewards) < 2 or max(rewards) == min(rewards)
