"""The losses of `forward_backward`, as the Tinker SDK's documentation defines them (its LossFnType names them).

Each is a sum over the tokens of every datum with the client's own per-token inputs, and nothing else: no mean over
tokens or datums, no normalisation by the server. A client that wants a mean puts it in its weights or advantages.
lp_t is log p(target_t), the model's log-probability of target_tokens[t] at position t of the model input; q_t is
the input `logprobs`, the sampler's log-probability of the same token; A_t is `advantages`; r_t = exp(lp_t - q_t).

    cross_entropy        loss = -sum_t weights_t * lp_t
    importance_sampling  loss = -sum_t r_t * A_t
    ppo                  loss = -sum_t min(r_t * A_t, clip(r_t, low, high) * A_t)
    cispo                loss = -sum_t sg[clip(r_t, low, high)] * lp_t * A_t          (sg: no gradient)
    dro                  loss = -sum_t (lp_t * A_t - beta / 2 * (lp_t - q_t)^2)
    gspo                 loss = -sum_t min(s_t * A_t, clip(s_t, low, high) * A_t), where
                         s = exp(mean over the tokens sequence_ratio_mask marks of (sg[lp_t] - q_t)) and
                         s_t = s * exp(lp_t - sg[lp_t]): s's value, lp_t's gradient (GSPO-token)

low and high (loss_fn_config `clip_low_threshold`, `clip_high_threshold`) bound the ratio itself, not its distance
from 1: the SDK docs' PPO page says "epsilon_low and epsilon_high ... currently fixed to 0.2" and passes
{"clip_low_threshold": 0.9, "clip_high_threshold": 1.1} for a tighter clip, so the defaults are 1 - 0.2 and
1 + 0.2. CISPO's page gives no default and shows {0.8, 1.2} as its example: the same. GSPO's page clips with the
same two names (its code is PPO's with s_t for r_t) and states no default: PPO's are taken, not the GSPO paper's
3e-4 / 4e-4 (which are distances from 1 in a length-normalised ratio, and would need other key names). DRO's page
names `beta` and shows 0.05 as an example, with no default: a dro request without beta is refused rather than
given a guessed one. GSPO's mean is per datum (a datum is one sequence); a datum whose sequence_ratio_mask marks no
token has no sequence ratio and fails the request. The SDK's Datum also types `clip_low_threshold` and
`clip_high_threshold` as per-token loss_fn_inputs; no docs page read here says what a per-token threshold means,
so a datum carrying one is refused ("reads no"), and the thresholds come from loss_fn_config only.

`stable_reinforce` is refused: its objective reads stability information the SDK's sampler records at sampling
time (SampleRequest.record_stability_info, the datum's provenance spans naming each token's sequence_id), which
this version, having no sampling, cannot record; its docs page publishes no formula to compute without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Inputs = Mapping[str, torch.Tensor]

# The ratio thresholds of ppo, cispo and gspo where loss_fn_config gives none: 1 - 0.2 and 1 + 0.2.
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def cross_entropy(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return -(target_logprobs * inputs["weights"]).sum()


def importance_sampling(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    advantages = inputs["advantages"]
    ratio = torch.exp(target_logprobs - inputs["logprobs"])  # r_t = p(x_t) / q(x_t)
    clipped = torch.clamp(ratio, inputs["clip_low_threshold"], inputs["clip_high_threshold"])
    # min(r A, clip(r) A): the more pessimistic of the two objectives, token by token
    return -torch.min(ratio * advantages, clipped * advantages).sum()


def cispo(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, inputs["clip_low_threshold"], inputs["clip_high_threshold"])
    # sg[clip(r)] * lp * A: the clipped ratio weighs the log-probability's gradient and gets none itself
    return -(clipped.detach() * target_logprobs * inputs["advantages"]).sum()


def dro(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    quadratic = (target_logprobs - inputs["logprobs"]) ** 2  # (log p/q)^2
    # lp A - beta/2 (log p/q)^2
    return -(target_logprobs * inputs["advantages"] - 0.5 * inputs["beta"] * quadratic).sum()


def gspo(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    in_ratio = inputs["sequence_ratio_mask"] != 0
    if not bool(in_ratio.any()):
        raise ValueError("gspo: a datum's sequence_ratio_mask marks no token, so it has no sequence ratio")
    # log s = mean over the marked tokens of log p/q, without gradient
    log_ratio = (target_logprobs.detach() - inputs["logprobs"])[in_ratio].mean()
    # s_t = sg[s] * p_t / sg[p_t]: every token has s's value and its own log-probability's gradient
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
    clipped = torch.clamp(ratio, inputs["clip_low_threshold"], inputs["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.min(ratio * advantages, clipped * advantages).sum()


# Each loss with the loss_fn_inputs it reads besides target_tokens, every one a float32 tensor of target_tokens' shape.
LOSSES: dict[str, tuple[Callable[[torch.Tensor, Inputs], torch.Tensor], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
    "cispo": (cispo, ("logprobs", "advantages")),
    "dro": (dro, ("logprobs", "advantages")),
    "gspo": (gspo, ("logprobs", "advantages", "sequence_ratio_mask")),
}

# Each loss's loss_fn_config keys with their defaults (None: the client must give it); a loss reads each as a tensor
# of that one value at every token.
CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": CLIP,
    "cispo": CLIP,
    "dro": {"beta": None},
    "gspo": CLIP,
}

# Why a loss the SDK names is refused, for the refusal's message.
REFUSED = {
    "stable_reinforce": "it needs the stability information a sampler records (record_stability_info), and this "
    "version does not sample",
}


def config_of(loss_fn: str, config: Mapping[str, float | str]) -> dict[str, float]:
    """Every loss_fn_config value `loss_fn` reads, the client's or the default; ValueError naming a key it does not
    read, a value that is not a number, or a key without default that the client did not give."""
    known = CONFIG[loss_fn]
    if extra := sorted(set(config) - set(known)):
        takes = ", ".join(known) if known else "no keys"
        raise ValueError(f"loss_fn_config: {loss_fn} takes {takes}, not {extra}")
    values: dict[str, float] = {}
    for key, default in known.items():
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"loss_fn_config: {loss_fn} needs {key!r} (the SDK's docs give it no default)")
        if isinstance(value, str):
            raise ValueError(f"loss_fn_config[{key!r}]: a number, not the string {value!r}")
        values[key] = float(value)
    return values
