"""The losses of `forward_backward`, as the Tinker SDK's documentation defines them (its LossFnType names them).

Each is a sum over the tokens of every datum with the client's own per-token inputs, and nothing else: no mean over
tokens or datums, no normalisation by the server. A client that wants a mean puts it in its weights or advantages.

    cross_entropy        loss = -sum_t weights_t * log p(target_t)
    importance_sampling  loss = -sum_t exp(log p(target_t) - logprobs_t) * advantages_t
                         (logprobs: the sampler's log-probs of the same tokens, the importance-sampling correction)

log p(target_t) is the model's log-probability of target_tokens[t] at position t of the model input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Inputs = Mapping[str, torch.Tensor]


def cross_entropy(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return -(target_logprobs * inputs["weights"]).sum()


def importance_sampling(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


# Each loss with the loss_fn_inputs it reads besides target_tokens, every one a float32 tensor of target_tokens' shape.
LOSSES: dict[str, tuple[Callable[[torch.Tensor, Inputs], torch.Tensor], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
}
