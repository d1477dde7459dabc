"""How a step's per-token loss terms add up to its loss (`algorithm.loss_aggregation`).

With l_it the term of token t of sample i (REINFORCE: -A_i log pi(y_it); PPO: the clipped surrogate), n_i sample i's
response length, N = sum_i n_i the step's response tokens and S its samples (every rank's, kept ones):

    token_mean     L = (1/N) sum_i sum_t l_it             NeMo-Aligner, veRL `token-mean`, TRL GRPO `dapo`/`bnpo`
    sequence_mean  L = (1/S) sum_i (1/n_i) sum_t l_it     veRL `seq-mean-token-mean`, TRL GRPO `grpo`
    constant       L = (1/(S*C)) sum_i sum_t l_it         Dr. GRPO with C = max_new_tokens (veRL
                                                          `seq-mean-token-sum-norm`, TRL GRPO `dr_grpo`); C = 1 is
                                                          TRL RLOO's per-sequence log-prob sum averaged over samples
                                                          (veRL `seq-mean-token-sum`)

token_mean gives every token the same weight, so long responses weigh more; sequence_mean gives every sample the
same weight, so a long response's tokens weigh less each (the length bias Dr. GRPO removes); constant weighs every
token the same, independently of the batch's lengths. The step-wide N and S are given to every micro-batch, so
gradient accumulation over micro-batches adds up to exactly the full batch's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reinforce.core.spec import LossAggregation, RunSpec


@dataclass(frozen=True)
class LossNormalizer:
    """One step's aggregation with the counts it divides by (every rank's)."""

    aggregation: LossAggregation
    num_tokens: int  # N
    num_samples: int  # S
    constant: float = 1.0  # C (`constant` only)

    def reduce(self, per_token: Tensor, mask: Tensor) -> Tensor:
        """This micro-batch's share of the step's loss, from per-token terms and the mask of the tokens that count
        ([B, T] each; a sample with no counted token contributes 0)."""
        mask = mask.bool()
        # Masked positions are replaced, not multiplied by 0: padding may hold inf, and inf * 0 = nan.
        masked = torch.where(mask, per_token, 0.0)
        if self.aggregation == "token_mean":
            return masked.sum() / max(self.num_tokens, 1)
        if self.aggregation == "sequence_mean":
            lengths = mask.sum(-1).clamp(min=1).to(masked.dtype)
            return (masked.sum(-1) / lengths).sum() / max(self.num_samples, 1)
        if self.aggregation == "constant":
            return masked.sum() / (max(self.num_samples, 1) * self.constant)
        raise ValueError(f"unknown loss_aggregation {self.aggregation!r}")


def step_normalizer(spec: RunSpec, num_tokens: int, num_samples: int) -> LossNormalizer:
    """The spec's aggregation for a step of N tokens and S samples; C defaults to generation.max_new_tokens."""
    alg = spec.algorithm
    constant = alg.loss_normalizer or float(spec.generation.max_new_tokens)
    return LossNormalizer(alg.loss_aggregation, num_tokens, num_samples, constant)
