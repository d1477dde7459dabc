"""log pi(y_t | x, y_<t) of each response token under the policy (and its distribution's entropy): the body's
states at the predicting positions (core/response_states.py) through the lm_head in chunks (chunked_head.py)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from reinforce.core.response_states import padded_like, response_states
from reinforce.trainer.chunked_head import head_logprobs


def response_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) = log_softmax(logits / temperature) for every response token.

    Returns (logprobs [B, T], mask [B, T]) right-padded to the longest response; mask is 1.0 on real tokens.
    Differentiable when grad is enabled. The lm_head runs only on the positions that predict response
    tokens: with a 49k vocabulary the prompt positions' logits would dominate time and memory.
    """
    logprobs, _, mask = _response_head(model, prompt_ids, response_ids, temperature, entropy=False)
    return padded_like(mask, logprobs), mask


def response_logprobs_and_entropy(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs as :func:`response_logprobs`, the entropy H_t = - sum_v pi(v) log pi(v) of each response token's
    distribution, mask), all [B, T]; both differentiable when grad is enabled."""
    logprobs, entropy, mask = _response_head(model, prompt_ids, response_ids, temperature, entropy=True)
    return padded_like(mask, logprobs), padded_like(mask, entropy), mask


def _response_head(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log-prob of each real response token [N], its distribution's entropy [N] if `entropy`, mask [B, T])."""
    states, targets, mask = response_states(model.base_model, prompt_ids, response_ids, model.config.pad_token_id or 0)
    logprobs, entropies = head_logprobs(model.lm_head, states, targets, temperature, entropy)
    return logprobs, entropies, mask
