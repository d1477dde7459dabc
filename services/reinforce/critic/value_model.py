"""The critic's value model: a transformer body with a scalar head, V(s_t) for every response token.

Two ways to build it, as NeMo-Aligner's PPO critic allows (it starts from a reward model checkpoint; starting from
the policy is TRL's and OpenRLHF's default):

- `policy`: the policy folder's architecture and weights without the LM head (AutoModel), and a new head
  nn.Linear(hidden, 1) initialised to zero, weight and bias. Zero rather than small random: every state's value
  starts at exactly 0, so the first GAE advantages are the discounted rewards themselves instead of rewards minus
  head noise, and the initial critic is the same bytes on every restart and replica without seeding anything. The
  head learns from the first step (its gradient is (V - R) * h); the body follows from the second.
- `reward_model`: a Hugging Face sequence classifier with num_labels == 1 (AutoModelForSequenceClassification): its
  body, and its `score` head copied into the value head (bias 0 where the classifier has none). It must share the
  policy's tokenizer: the critic is given the policy's token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

from reinforce.core.response_states import response_states
from reinforce.core.spec import CriticInit


class ValueModel(nn.Module):
    """body: a Hugging Face base model (LlamaModel, ...) that returns last_hidden_state; head: Linear(hidden, 1)."""

    def __init__(self, body: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = head

    @property
    def config(self) -> PretrainedConfig:
        return self.body.config

    @property
    def device(self) -> torch.device:
        return self.head.weight.device


def value_model_from_policy(folder: str | Path) -> ValueModel:
    body = AutoModel.from_pretrained(Path(folder), dtype=torch.float32, local_files_only=True)
    head = nn.Linear(body.config.hidden_size, 1, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return ValueModel(body, head)


def value_model_from_reward_model(folder: str | Path) -> ValueModel:
    classifier = AutoModelForSequenceClassification.from_pretrained(
        Path(folder), dtype=torch.float32, local_files_only=True
    )
    if classifier.config.num_labels != 1:
        raise ValueError(
            f"{folder}: a reward model for the critic has num_labels 1, not {classifier.config.num_labels}"
        )
    score = getattr(classifier, "score", None)
    if not isinstance(score, nn.Linear) or score.out_features != 1:
        raise ValueError(f"{folder}: no `score` Linear head (decoder-only sequence classifiers have one)")
    head = nn.Linear(score.in_features, 1, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(score.weight)
        head.bias.copy_(score.bias if score.bias is not None else torch.zeros(1))
    return ValueModel(classifier.base_model, head)


def load_value_model(folder: str | Path, init: CriticInit) -> ValueModel:
    """The value model in float32 and eval mode (the service switches to train mode for its updates)."""
    if init == "policy":
        model = value_model_from_policy(folder)
    elif init == "reward_model":
        model = value_model_from_reward_model(folder)
    else:
        raise ValueError(f"unknown critic init {init!r} (expected policy or reward_model)")
    return model.eval()


def response_values(
    model: ValueModel, prompt_ids: list[list[int]], response_ids: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """V(s_t) for every response token t: the head on the hidden state that predicts token t (the state before it
    is emitted), the very positions whose log-probs `response_logprobs` returns.

    Returns (values [B, T], mask [B, T]) right-padded to the longest response, 0 on padding; differentiable when
    grad is enabled. The head runs only on the response positions.
    """
    pad = model.config.pad_token_id or 0
    states, _, mask = response_states(model.body, prompt_ids, response_ids, pad)
    device = states.device
    picked = model.head(states.float()).squeeze(-1)  # [N], N = real response tokens
    values = torch.zeros(mask.shape, dtype=picked.dtype, device=device)
    values[mask.bool()] = picked  # row-major order matches response_positions
    return values, mask


# ---- the loss the critic trains on (PPO's L_critic, trainer/algorithms/ppo.py) --------------------------------
@dataclass(frozen=True)
class CriticLoss:
    """L_critic (differentiable) and the fraction of tokens whose clipped error won the max (detached)."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
    num_tokens: int | None = None,
) -> CriticLoss:
    """L_critic = (1/N) sum_t mask_t * 0.5 * max((V - R)^2, (V^clip - R)^2) of [B, T] values (differentiable),
    with V^clip = V_old + clip(V - V_old, -eps_v, eps_v), old_values V_old and returns R.

    value_clip is eps_v; 0 (or less) turns the clipping off, as NeMo-Aligner's loss_clip_val does. N is num_tokens
    (the whole minibatch's, so that micro-batches add up to its gradient) or this call's own token count.
    """
    returns, old_values = returns.detach(), old_values.detach()
    error = (values - returns).square()
    if value_clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (clipped_values - returns).square()
        worst = torch.maximum(error, clipped_error)
        clip_fraction = _token_mean((clipped_error > error).detach().to(values.dtype), mask, None)
    else:
        worst = error
        clip_fraction = torch.zeros((), dtype=values.dtype, device=values.device)
    return CriticLoss(0.5 * _token_mean(worst, mask, num_tokens), clip_fraction)


def _token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: int | None) -> torch.Tensor:
    mask = mask.bool()
    count = int(mask.sum()) if num_tokens is None else num_tokens
    return torch.where(mask, values, 0.0).sum() / max(count, 1)
