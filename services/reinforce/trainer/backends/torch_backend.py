"""The torch backend: the policy and its frozen reference as Hugging Face models, AdamW, data parallelism by
summing gradients over torchrun ranks (trainer/distributed.py).

training.precision bf16 (what auto, the default, resolves to on this backend where the CPU multiplies bfloat16 in
hardware: core/hardware.py) is mixed precision as Megatron and FSDP run it: the policy's float32 weights are the
master copy (AdamW's, its state float32 too; what checkpoints and weight versions hold), and every forward and
backward runs on a bfloat16 copy of them (`_compute_copy`), so activations and their elementwise work are bfloat16
as well as the matmuls; each backward's bfloat16 gradients are added into float32 gradients of the master weights,
and the copy takes the new weights after each optimizer step.
A LoRA policy trains its adapters under autocast instead (its frozen base is the reference). The frozen reference
is a bfloat16 copy. Buffers stay float32 in every copy (why: core/policy.py's with_parameters_in).
logprobs.response_logprobs takes the log-softmax in float32 either way.

training.attention auto: short sequences (RL responses to chat prompts: about 80 tokens in the benchmarks) run
attention as plain matmuls, which on CPU is about twice as fast as torch's flash kernel at that length; long ones
keep the kernel. Hugging Face models switch implementation in place, so each micro-batch gets the faster one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from reinforce.core.hardware import bfloat16_is_native
from reinforce.core.lora import LORA_FORMAT, lora_config, lora_tensors, merge_into
from reinforce.core.optim import adamw
from reinforce.core.policy import load_policy
from reinforce.core.spec import LoraSpec, TrainingSpec
from reinforce.trainer.backends.base import TrainerBackend, lr_factor
from reinforce.trainer.distributed import Ranks
from reinforce.trainer.logprobs import response_logprobs, response_logprobs_and_entropy

# training.attention auto on CPU: eager up to this padded length, sdpa beyond (the crossover measured on this
# machine lies between 160 and 320 tokens)
EAGER_ATTENTION_MAX_TOKENS = 256


class TorchBackend(TrainerBackend):
    name = "torch"

    def __init__(self, training: TrainingSpec, policy_dir: Path, ranks: Ranks) -> None:
        super().__init__()
        self.training = training
        self.ranks = ranks
        self.policy_dir = policy_dir
        self.policy = load_policy(policy_dir).train()
        precision = training.resolved_precision(bfloat16_is_native("cpu"))
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.peft = None
        if training.lora is not None:
            # LoRA: PEFT injects adapters into self.policy in place; the reference is the same model with the
            # adapters disabled, so there is no second copy of the weights.
            self.peft = _with_lora(self.policy, training.lora)
            self.reference = None
        else:
            # The reference is always the initial policy, also after a resume.
            self.reference = load_policy(policy_dir, self.compute_dtype).requires_grad_(False)
        # what every forward and backward runs on: the policy itself, or (bf16 without LoRA) its bfloat16 copy
        self.compute = self.policy
        if self.compute_dtype != torch.float32 and self.peft is None:
            self.compute = _compute_copy(self.policy, self.compute_dtype)
        if training.gradient_checkpointing:
            _checkpoint_layers(self.compute)
        t = training
        self.optimizer = adamw(self.trainable_parameters(), t.lr, t.adam_betas, t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(t, s))

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 with LoRA: the policy's matmuls in bfloat16 (the backward follows the forward's casts); otherwise
        nothing, for the compute copy already holds the precision it runs in."""
        if self.peft is None or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        device = next(self.policy.parameters()).device.type
        return torch.autocast(device, dtype=self.compute_dtype)

    def use_attention_for(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
        """Switch both models to training.attention's kernel for a micro-batch of these sequences."""
        kernel = self.training.attention
        if kernel == "auto":
            padded = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
            on_cpu = next(self.policy.parameters()).device.type == "cpu"
            kernel = "eager" if on_cpu and padded <= EAGER_ATTENTION_MAX_TOKENS else "sdpa"
        for model in (self.compute, self.reference):
            if model is not None and model.config._attn_implementation != kernel:
                model.set_attn_implementation(kernel)

    def logprob_module(self) -> torch.nn.Module:
        return self.compute

    def policy_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.use_attention_for(prompt_ids, response_ids)
        with self.autocast():
            return response_logprobs(self.compute, prompt_ids, response_ids, temperature)

    def policy_logprobs_and_entropy(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.use_attention_for(prompt_ids, response_ids)
        with self.autocast():
            return response_logprobs_and_entropy(self.compute, prompt_ids, response_ids, temperature)

    @torch.no_grad()
    def reference_logprobs(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
    ) -> torch.Tensor:
        self.use_attention_for(prompt_ids, response_ids)
        if self.peft is not None:
            with self.peft.disable_adapter(), self.autocast():
                return response_logprobs(self.policy, prompt_ids, response_ids, temperature)[0]
        return response_logprobs(self.reference, prompt_ids, response_ids, temperature)[0]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def optimizer_step(self) -> tuple[float, float]:
        self.ranks.sum_gradients(self.trainable_parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.training.max_grad_norm)
        stepped = self.step_if_finite(grad_norm)
        self._refresh_compute()
        return stepped

    def _refresh_compute(self) -> None:
        """The compute copy (if any) takes the master weights, rounded to its precision."""
        if self.compute is not self.policy:
            with torch.no_grad():
                for computed, master in zip(self.compute.parameters(), self.policy.parameters(), strict=True):
                    computed.copy_(master)

    def publishable_model(self) -> torch.nn.Module:
        return self.policy

    def weights_to_publish(self) -> tuple[torch.nn.Module | dict[str, torch.Tensor], dict[str, str]]:
        if self.peft is None:
            return self.policy, {}
        return lora_tensors(self.policy), {"format": LORA_FORMAT, "lora_scaling": repr(self.lora_scaling())}

    def lora_scaling(self) -> float:
        return self.training.lora.alpha / self.training.lora.rank

    def save_final(self, folder: Path) -> None:
        if self.peft is None:
            self.policy.save_pretrained(folder)
            return
        self.peft.save_pretrained(folder / "adapter")  # the adapter alone (PEFT's format)
        merged = load_policy(self.policy_dir)
        merge_into(merged, lora_tensors(self.policy), self.lora_scaling())
        merged.save_pretrained(folder)  # merged: a plain Hugging Face model

    def save_state(self, folder: Path) -> None:
        save_model(self.policy, str(folder / "model.safetensors"))
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        load_model(self.policy, str(folder / "model.safetensors"))
        self._refresh_compute()
        state = torch.load(folder / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _compute_copy(master: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of `master` with its parameters in `dtype` whose backward adds each parameter's gradient into the
    float32 gradient of `master`'s, then drops its own: micro-batches accumulate in float32, and AdamW steps
    `master`. Tied weights stay tied (one parameter, one hook, called once its uses are summed). Each parameter is
    cast as it is copied, so no second float32 model is ever held; buffers are copied as they are (float32)."""
    cast = {id(p): torch.nn.Parameter(p.detach().to(dtype), p.requires_grad) for p in master.parameters()}
    compute = copy.deepcopy(master, memo=cast)
    for kept, computed in zip(master.parameters(), compute.parameters(), strict=True):
        if computed.requires_grad:
            computed.register_post_accumulate_grad_hook(functools.partial(_add_gradient_into, kept))
    return compute


def _add_gradient_into(master: torch.nn.Parameter, computed: torch.Tensor) -> None:
    if master.grad is None:
        master.grad = computed.grad.to(master.dtype)
    else:
        master.grad.add_(computed.grad)
    computed.grad = None


def _checkpoint_layers(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward (training.gradient_checkpointing) instead of keeping its
    activations: Hugging Face's per-layer checkpointing, which runs only in train mode; the policy always is (its
    attention dropout, 0 in SmolLM2's and Llama's configs, applies either way; the recompute replays the RNG state).

    Set here rather than by `gradient_checkpointing_enable`, which also turns the model's KV cache off: the recompute
    would append to the cache a second time. response_states needs the cache (a prompt's samples attend to its keys
    and values), so the layers keep it and each recompute sees the cache as its forward did (_checkpoint_with_cache).
    Non-reentrant: autocast carries into the recompute, and a LoRA policy's adapters get their gradients without the
    frozen layers' inputs requiring grad.
    """
    layers = model.base_model.layers
    if not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        raise ValueError(f"training.gradient_checkpointing: {type(model).__name__} has no checkpointable layers")
    logging.getLogger(GradientCheckpointingLayer.__module__).addFilter(_not_the_cache_warning)  # once: same object
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = True
        layer._can_checkpoint_with_cache = True
        layer._gradient_checkpointing_func = functools.partial(_checkpoint_with_cache, index)


def _not_the_cache_warning(record: logging.LogRecord) -> bool:
    """False for "Caching is incompatible with gradient checkpointing ... Setting use_cache=False", which each
    checkpointed layer's call logs: it clears that flag, which the attention does not read, and keeps the cache,
    which it does, so the warning would mislead."""
    return "Caching is incompatible with gradient checkpointing" not in record.getMessage()


def _checkpoint_with_cache(index: int, layer_call: functools.partial, *args: torch.Tensor) -> torch.Tensor:
    """torch's checkpoint of decoder layer `index`'s call, whose recompute finds that layer's KV cache as it was
    before the forward's update (so the update returns the same keys and values again) and leaves it as it was."""
    cache = layer_call.keywords.get("past_key_values")
    if cache is None:
        return checkpoint(layer_call, *args, use_reentrant=False)
    cached = cache.layers[index]
    before = dict(vars(cached))  # update() rebinds its tensors (torch.cat), so references are a snapshot

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _state_as(cached, before)

    return checkpoint(layer_call, *args, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _state_as(obj: object, state: dict) -> Iterator[None]:
    """`obj`'s attributes set to `state` inside the block, back to what they were after it."""
    now = dict(vars(obj))
    vars(obj).clear()
    vars(obj).update(state)
    try:
        yield
    finally:
        vars(obj).clear()
        vars(obj).update(now)


def _with_lora(model: torch.nn.Module, lora: LoraSpec):  # a peft.PeftModel
    from peft import get_peft_model  # lora_config has checked that PEFT is installed

    return get_peft_model(model, lora_config(model, lora))
