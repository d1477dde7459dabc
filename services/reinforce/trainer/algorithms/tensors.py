"""Tensor helpers the algorithms share: masked means and whitening over response tokens (summed over data-parallel
ranks where a statistic spans the batch), and the per-token KL estimates to the reference policy.

Tensors are right-padded [B, T] with mask 1 on each response's real tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

SumOverRanks = Callable[[Tensor], Tensor]


def local_sum(tensor: Tensor) -> Tensor:
    """A single rank's sum over ranks: the tensor itself."""
    return tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Mean of `values` where mask is 1; 0 where a row has no unmasked entry (an empty response).

    Padded positions are replaced, not multiplied by 0: padding may hold inf (exp of garbage), and inf * 0 = nan.
    """
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum(dim) / mask.sum(dim).clamp(min=1).to(values.dtype)


def masked_mean_var(values: Tensor, mask: Tensor, all_reduce: SumOverRanks = local_sum) -> tuple[Tensor, Tensor]:
    """Mean and uncorrected (population) variance of the unmasked entries of the whole tensor, as scalars.

    all_reduce sums a tensor over data-parallel ranks (`Ranks.sum_tensor`): the statistics of every rank's share.
    """
    mask = mask.bool()
    count, total = all_reduce(torch.stack([mask.sum().to(values.dtype), torch.where(mask, values, 0.0).sum()]))
    count = count.clamp(min=1)
    mean = total / count
    var = all_reduce(torch.where(mask, (values - mean).square(), 0.0).sum()) / count
    return mean, var


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, all_reduce: SumOverRanks = local_sum) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the unmasked entries of the whole batch; 0 on padding.

    The statistics are over every token of the tensor passed in (and of the other ranks' through all_reduce):
    whiten the whole step's batch, not a micro-batch.
    """
    mean, var = masked_mean_var(values, mask, all_reduce)
    return torch.where(mask.bool(), (values - mean) * torch.rsqrt(var + eps), 0.0)


KLEstimator = Literal["k1", "k2", "k3"]


def kl_per_token(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator, use_absolute_kl: bool, clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from d_t = log pi(y_t) - log pi_ref(y_t), y_t ~ pi, clamped to
    [-clamp, clamp] (None: not clamped). One token far from the reference (k3 at d = -15: 3.3e6) would otherwise
    outweigh a whole batch."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        kl = d.abs() if use_absolute_kl else d
    elif estimator == "k2":
        kl = d.square() / 2
    elif estimator == "k3":
        kl = torch.exp(-d) - 1 + d
    else:
        raise ValueError(f"unknown kl_estimator {estimator!r} (expected k1, k2 or k3)")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def sequence_kl(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: KLEstimator,
    use_absolute_kl: bool,
    clamp: float | None = None,
) -> Tensor:
    """KL_i: the masked mean over each response's tokens of the (clamped) estimate. Shapes [B, T] -> [B]."""
    return masked_mean(kl_per_token(logprobs, ref_logprobs, estimator, use_absolute_kl, clamp), mask)
