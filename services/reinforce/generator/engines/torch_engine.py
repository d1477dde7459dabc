"""The torch engine: the reference sampler, k responses per prompt with their per-token log-probs.

All rows of all prompts decode together with one KV cache. Log-probs are taken exactly the way
`trainer/logprobs.py`'s `response_logprobs` takes them (model body, lm_head on the predicting position, float32
log_softmax(logits / temperature) of the unfiltered distribution), so the trainer's recomputation differs
only by floating-point noise: that difference is the train/inference mismatch metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.lora import LORA_FORMAT, adapted_modules, merge_into, read_lora_version
from reinforce.core.policy import load_policy, load_tokenizer
from reinforce.core.spec import GenerationSpec, LoraSpec
from reinforce.core.weights import WeightError, module_loader
from reinforce.generator.engines.base import GenerationEngine, SampledSequence
from reinforce.generator.engines.common import merge_eos_ids


class TorchEngine(GenerationEngine):
    """The policy as a Hugging Face model (float32, or bfloat16 with generation.dtype), sampled by `sample` below."""

    name = "torch"

    def __init__(
        self, policy_dir: Path, generation: GenerationSpec, num_samples: int, lora: LoraSpec | None = None
    ) -> None:
        """`lora`: the run's training.lora, whose target modules are the only ones a LoRA version may adapt."""
        super().__init__(policy_dir, generation, num_samples)
        self.lora_targets = () if lora is None else tuple(lora.target_modules)
        self.tokenizer = load_tokenizer(policy_dir)
        dtype = getattr(torch, generation.resolved_dtype(bfloat16_is_native("cpu")))
        self.model = load_policy(policy_dir, dtype)  # weight version 0
        self._load = module_loader(self.model)
        self._lora_base: dict[str, torch.Tensor] = {}  # LoRA: each adapted module's base weight

    def _sample(
        self, prompts: list[list[int]], seeds: list[int], k: int, generation: GenerationSpec, limits: list[int]
    ) -> list[list[SampledSequence]]:
        return sample(self.model, self.tokenizer, prompts, k, generation, seeds, limits=limits)

    def load_weights(self, path: Path) -> None:
        with safe_open(str(path), framework="pt") as f:
            is_lora = (f.metadata() or {}).get("format") == LORA_FORMAT
        if not is_lora:
            self._load(path)
            return
        adapters, scaling = read_lora_version(path, self.lora_targets)
        # LoRA: only adapters travel; the base weights are the ones this engine started with (weight version 0)
        params = dict(self.model.named_parameters())
        for module in adapted_modules(adapters):
            if module not in self._lora_base:
                if f"{module}.weight" not in params:
                    raise WeightError(f"{path}: adapter for {module!r}, which the model does not have")
                self._lora_base[module] = params[f"{module}.weight"].detach().clone()
        merge_into(self.model, adapters, scaling, self._lora_base)


@dataclass
class _Rows:
    """Per-row decoding state; row r belongs to prompt r // num_samples."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    ended: list[bool]
    active: torch.Tensor  # bool [B]: still sampling
    limits: list[int]  # each row's max new tokens

    @classmethod
    def start(cls, n: int, device: torch.device, limits: list[int]) -> _Rows:
        return cls(
            [[] for _ in range(n)],
            [[] for _ in range(n)],
            [False] * n,
            torch.ones(n, dtype=torch.bool, device=device),
            limits,
        )


@torch.inference_mode()
def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    num_samples: int,
    gen: GenerationSpec,
    seeds: list[int],
    temperature: float | None = None,
    limits: list[int] | None = None,
) -> list[list[SampledSequence]]:
    """For each prompt, `num_samples` responses; prompt i's rows draw from a generator seeded by seeds[i].

    `temperature` overrides gen.temperature (validation); 0 is greedy: the likeliest token each time, its
    log-prob recorded from the unscaled distribution. `limits`: each prompt's max new tokens (default
    gen.max_new_tokens); a row that reaches its limit did not end.
    """
    temperature = gen.temperature if temperature is None else temperature
    greedy = temperature == 0
    limits = [gen.max_new_tokens] * len(prompts) if limits is None else limits
    _check_inputs(model, prompts, num_samples, limits, seeds)
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    configured_eos = getattr(model.generation_config, "eos_token_id", None)
    eos = torch.tensor(sorted(merge_eos_ids(tokenizer, configured_eos)), dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    cache = DynamicCache(config=model.config)
    logits, attention, positions = _prefill(model, prompts, num_samples, pad, cache)
    rows = _Rows.start(logits.shape[0], device, [n for n in limits for _ in range(num_samples)])
    for _ in range(max(limits)):
        scaled = logits.float() / (1.0 if greedy else temperature)
        if greedy:
            tokens = scaled.argmax(dim=-1)
        else:
            tokens = _draw(_filter(scaled, gen.top_k, gen.top_p), generators, num_samples)
        _record(rows, tokens, torch.log_softmax(scaled, dim=-1), eos, tokenizer, gen.stop_strings)
        if not rows.active.any():
            break
        # Finished rows are fed pad tokens (masked out) so the batch keeps its shape; nothing is recorded.
        fed = torch.where(rows.active, tokens, torch.full_like(tokens, pad))
        attention = torch.cat([attention, rows.active[:, None].long()], dim=1)
        positions = positions + 1
        logits = _next_logits(model, fed[:, None], attention, positions[:, None], cache)
    return _collect(rows, tokenizer, len(prompts), num_samples)


def _check_inputs(
    model: PreTrainedModel, prompts: list[list[int]], num_samples: int, limits: list[int], seeds: list[int]
) -> None:
    if len(seeds) != len(prompts) or len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds and {len(limits)} limits")
    if num_samples < 1 or not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample needs num_samples >= 1 and at least one non-empty prompt")
    limit = model.config.max_position_embeddings
    longest, new_tokens = max((len(p) + n, n) for p, n in zip(prompts, limits, strict=True))
    if longest > limit:
        raise ValueError(
            f"longest prompt ({longest - new_tokens} tokens) + max_new_tokens ({new_tokens}) exceeds the model's "
            f"max_position_embeddings ({limit}); lower data.max_prompt_tokens or generation.max_new_tokens"
        )


def _prefill(
    model: PreTrainedModel, prompts: list[list[int]], num_samples: int, pad: int, cache: DynamicCache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run each distinct prompt once, then copy its cache to its num_samples rows."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding: every row's last token is at the same column
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt) :] = 1
    ids, attention = ids.to(device), attention.to(device)
    # Positions count real tokens only, so a prompt gets the same positions however much it is padded.
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    logits = _next_logits(model, ids, attention, positions, cache)
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)
    repeat = lambda t: t.repeat_interleave(num_samples, dim=0)  # noqa: E731
    return repeat(logits), repeat(attention), repeat(positions[:, -1])


def _next_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
) -> torch.Tensor:
    """Logits at each row's last position only (the lm_head on all prompt positions would be wasted)."""
    out = model.base_model(
        input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
    )
    return model.lm_head(out.last_hidden_state[:, -1])


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Restrict what can be sampled (top-k, then nucleus); the recorded log-probs stay unfiltered."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the likeliest always survives.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[:, 0] = False
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def _draw(scaled: torch.Tensor, generators: list[torch.Generator], num_samples: int) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row from its prompt's generator.

    The RNG use per prompt is fixed (num_samples numbers a step), so a prompt samples the same tokens
    whatever else is in the batch.
    """
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(num_samples, generator=g, device=scaled.device) for g in generators])
    # Scale by the total so float rounding in the cumsum can never push u past the last bin.
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return tokens.clamp(max=scaled.shape[-1] - 1)


def _record(
    rows: _Rows,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    eos: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
    stop_strings: list[str],
) -> None:
    picked = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    is_eos = torch.isin(tokens, eos).tolist()
    ids = tokens.tolist()
    for r in rows.active.nonzero().flatten().tolist():
        rows.tokens[r].append(ids[r])
        rows.logprobs[r].append(picked[r])
        if is_eos[r] or (stop_strings and _has_stop(tokenizer, rows.tokens[r], stop_strings)):
            rows.ended[r] = True
            rows.active[r] = False
        elif len(rows.tokens[r]) == rows.limits[r]:
            rows.active[r] = False


def _has_stop(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop_strings: list[str]) -> bool:
    # Decode the whole response: a stop string may span tokens, and a byte-level token may only complete
    # a character together with the next one.
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return any(s in text for s in stop_strings)


def _collect(
    rows: _Rows, tokenizer: PreTrainedTokenizerBase, num_prompts: int, num_samples: int
) -> list[list[SampledSequence]]:
    sequences = [
        SampledSequence(
            token_ids=tokens,
            logprobs=logprobs,
            is_end=ended,
            text=tokenizer.decode(tokens, skip_special_tokens=True),
        )
        for tokens, logprobs, ended in zip(rows.tokens, rows.logprobs, rows.ended, strict=True)
    ]
    return [sequences[i * num_samples : (i + 1) * num_samples] for i in range(num_prompts)]
