"""The models of the training API: one base model, loaded once, and each tenant's LoRA adapter and AdamW.

Every model a client creates is a PEFT adapter of its own on the one base model (PEFT's named adapters:
core/lora.py's lora_config builds each one's configuration, as it builds the trainer's), with an AdamW of its own
over that adapter's parameters (core/optim.py's, as the trainer's). A request of one model runs with only its
adapter active; a forward_backward adds into that adapter's gradients alone, so tenants never see each other's
state. What a LoRA `rank` means: r of every adapter, the update of an adapted Linear being (alpha / r) * B @ A with
A [r, in] and B [out, r]; alpha is the run spec's training.lora.alpha (LoraSpec's default without that section).

The client's flags choose the adapted modules (Llama's names, SmolLM2's too): train_attn q_proj, k_proj, v_proj,
o_proj; train_mlp gate_proj, up_proj, down_proj; train_unembed lm_head, refused where the output layer is tied to
the input embeddings (the generators merge adapters into the weights). Everything computes in float32.

Only the worker thread (worker.py) calls the methods that compute or change a model; `info` is read by the server.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from tinker import types
from transformers import PreTrainedModel

from reinforce.core.lora import lora_config
from reinforce.core.optim import adamw
from reinforce.core.policy import load_policy
from reinforce.core.spec import LoraSpec
from reinforce.training_api import checkpoint, live
from reinforce.training_api.losses import LOSSES
from reinforce.training_api.wire import Batch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
PEFT_PREFIX = "base_model.model."  # what PEFT's state-dict names carry before the plain model's


def target_modules(config: types.LoraConfig) -> list[str]:
    """The Linear modules a client's LoRA flags adapt; ValueError naming the flags where none is set."""
    chosen = [
        *(ATTENTION if config.train_attn else ()),
        *(MLP if config.train_mlp else ()),
        *(UNEMBED if config.train_unembed else ()),
    ]
    if not chosen:
        raise ValueError("lora_config: one of train_attn, train_mlp and train_unembed must be true")
    return chosen


@dataclass
class Tenant:
    model_id: str
    adapter: str  # its PEFT adapter's name
    lora: LoraSpec
    parameters: list[torch.nn.Parameter]  # its adapter's, in a fixed order (its optimizer's and checkpoints')
    optimizer: torch.optim.AdamW


class Tenants:
    def __init__(
        self, base_dir: Path, base_model: str, alpha: float, seed: int, checkpoints: Path, run_id: str
    ) -> None:
        self.base_model = base_model
        self.base_dir = base_dir.resolve()  # the base model's folder and its tokenizer's, absolute for any client
        self.alpha = alpha
        self.seed = seed
        self.checkpoints = checkpoints
        self.run_id = run_id  # in each checkpoint's manifest
        self.plain: PreTrainedModel = load_policy(base_dir)  # float32, eval mode: no dropout anywhere
        self.plain.requires_grad_(False)
        self.peft: PeftModel | None = None
        self.tenants: dict[str, Tenant] = {}
        self._adapters = 0  # adapters made: each one's name is new, also after another was unloaded
        self._lock = threading.Lock()  # the server reads `info` while the worker adds tenants

    @property
    def vocab_size(self) -> int:
        return self.plain.config.vocab_size

    @property
    def max_context_length(self) -> int:
        return self.plain.config.max_position_embeddings

    def info(self, model_id: str) -> types.GetInfoResponse:
        """KeyError for a model this process does not hold."""
        with self._lock:
            tenant = self.tenants[model_id]
        model = types.ModelData(
            arch=self.plain.config.model_type, model_name=self.base_model, tokenizer_id=str(self.base_dir)
        )
        return types.GetInfoResponse(
            type="get_info", model_data=model, model_id=model_id, is_lora=True, lora_rank=tenant.lora.rank,
            model_name=self.base_model,
        )  # fmt: skip

    def create(self, model_id: str, config: types.LoraConfig) -> None:
        """A new tenant with a fresh adapter (B = 0: it starts as the base model; A drawn from the request's seed,
        the run's seed where it gives none)."""
        lora = LoraSpec(rank=config.rank, alpha=self.alpha, target_modules=target_modules(config))
        seed = self.seed if config.seed is None else config.seed
        self._add(model_id, lora, seed)

    def _add(self, model_id: str, lora: LoraSpec, seed: int) -> Tenant:
        if model_id in self.tenants:
            raise ValueError(f"model {model_id} exists already")
        try:
            peft_config = lora_config(self.plain, lora)
        except ValueError:
            raise ValueError(
                "lora_config.train_unembed: this base model's output layer is tied to its input embeddings; "
                "pass train_unembed=False"
            ) from None
        adapter = f"tenant{self._adapters}"
        self._adapters += 1
        with torch.random.fork_rng(devices=[]):  # the adapter's init draws from its own seed, not the process's
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.plain, peft_config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, peft_config)
        parameters = [p for name, p in sorted(self.peft.named_parameters()) if f".{adapter}." in name]
        for parameter in parameters:
            parameter.requires_grad_(True)
        defaults = types.AdamParams()
        optimizer = adamw(parameters, defaults.learning_rate, (defaults.beta1, defaults.beta2), defaults.weight_decay)
        tenant = Tenant(model_id, adapter, lora, parameters, optimizer)
        with self._lock:
            self.tenants[model_id] = tenant
        return tenant

    def _activate(self, model_id: str) -> Tenant:
        tenant = self.tenants.get(model_id)
        if tenant is None:
            raise ValueError(f"model_id {model_id!r}: no such model on this server")
        assert self.peft is not None  # a tenant exists
        self.peft.set_adapter(tenant.adapter)
        for parameter in tenant.parameters:  # set_adapter may freeze what it switches to
            parameter.requires_grad_(True)
        return tenant

    def forward_backward(self, model_id: str, batch: Batch) -> tuple[list[torch.Tensor], float]:
        """Each datum's log-probs of its target tokens and the loss summed over datums; unless batch.forward_only,
        the loss's gradients are added into the tenant's."""
        self._activate(model_id)
        assert self.peft is not None
        loss_fn, _ = LOSSES[batch.loss_fn]
        lengths = [len(ids) for ids in batch.tokens]
        pad = self.plain.config.pad_token_id or 0
        ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(batch.tokens):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        with torch.no_grad() if batch.forward_only else contextlib.nullcontext():
            # right-padded: each real position attends to the real ones before it, as it would alone
            logits = self.peft(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = [
                logprobs[row, :n].gather(-1, inputs["target_tokens"][:, None]).squeeze(-1)
                for row, (n, inputs) in enumerate(zip(lengths, batch.inputs, strict=True))
            ]
            loss = sum((loss_fn(lp, inputs) for lp, inputs in zip(targets, batch.inputs, strict=True)), torch.zeros(()))
            if not batch.forward_only:
                loss.backward()
        return [lp.detach() for lp in targets], float(loss.detach())

    def optim_step(self, model_id: str, params: types.AdamParams) -> dict[str, float]:
        """One AdamW step with the request's hyperparameters over the gradients added since the last, then zero
        them. grad_clip_norm > 0 clips the global norm first (torch's clip_grad_norm_); 0 does not clip."""
        tenant = self._activate(model_id)
        for group in tenant.optimizer.param_groups:
            group.update(
                lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                weight_decay=params.weight_decay,
            )  # fmt: skip
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(tenant.parameters, max_norm)
        tenant.optimizer.step()
        tenant.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "learning_rate": params.learning_rate}

    def save(self, model_id: str, name: str, overwrite: bool, request_id: str | None = None) -> str:
        """Its adapter and optimizer state as checkpoint `name` (checkpoint.py); the tinker:// path. request_id:
        the request that saves it, recorded in the checkpoint so that its replay after a crash finds it done."""
        tenant = self._activate(model_id)
        assert self.peft is not None
        adapters = {
            name.removeprefix(PEFT_PREFIX): tensor
            for name, tensor in get_peft_model_state_dict(
                self.peft, adapter_name=tenant.adapter, save_embedding_layers=False
            ).items()
        }
        state = checkpoint.State(
            self.base_model, tenant.lora, adapters, tenant.optimizer.state_dict()["state"], len(tenant.parameters)
        )
        return checkpoint.save(self.checkpoints, model_id, name, state, overwrite, self.run_id, request_id)

    def load(self, model_id: str, path: str, with_optimizer: bool, create: bool) -> None:
        """Checkpoint `path` into model `model_id`, created from it (create: its rank and modules) or existing
        (they must match); with_optimizer also its AdamW state, else that optimizer starts afresh."""
        state = checkpoint.load(self.checkpoints, path)
        if state.base_model != self.base_model:
            raise ValueError(f"path {path}: a checkpoint of base model {state.base_model!r}, not {self.base_model!r}")
        if create:
            tenant = self._add(model_id, state.lora, self.seed)
        else:
            tenant = self._activate(model_id)
            if tenant.lora != state.lora:
                raise ValueError(f"path {path}: its adapters ({state.lora}) are not this model's ({tenant.lora})")
        assert self.peft is not None
        plain_names = {PEFT_PREFIX + name: tensor for name, tensor in state.adapters.items()}
        result = set_peft_model_state_dict(self.peft, plain_names, adapter_name=tenant.adapter)
        if result.unexpected_keys:
            raise ValueError(f"path {path}: tensors this model has no place for: {result.unexpected_keys[:3]}")
        fresh = tenant.optimizer.state_dict()
        if with_optimizer:
            fresh["state"] = state.optimizer
        else:
            fresh["state"] = {}
        tenant.optimizer.load_state_dict(fresh)

    def capture(self, model_id: str) -> live.ModelState:
        """Everything of a tenant that later requests depend on: its adapter, the gradients added and not yet
        stepped, its AdamW state and hyperparameters (references, not copies: written before the next request)."""
        tenant = self.tenants[model_id]
        tensors = {f"param.{i}": p for i, p in enumerate(tenant.parameters)}
        tensors |= {f"grad.{i}": p.grad for i, p in enumerate(tenant.parameters) if p.grad is not None}
        optimizer = tenant.optimizer.state_dict()
        for index, entry in optimizer["state"].items():
            tensors |= {f"optim.{index}.{key}": value for key, value in entry.items()}
        return live.ModelState(tenant.lora, optimizer["param_groups"], tensors)

    def restore(self, model_id: str, state: live.ModelState) -> None:
        """A tenant as `capture` saw it, bit for bit (a fresh adapter overwritten: its seed does not matter)."""
        tenant = self._add(model_id, state.lora, self.seed)
        with torch.no_grad():
            for i, parameter in enumerate(tenant.parameters):
                parameter.copy_(state.tensors[f"param.{i}"])
                grad = state.tensors.get(f"grad.{i}")
                parameter.grad = None if grad is None else grad.clone()
        moments: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in state.tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                moments.setdefault(int(index), {})[name] = value
        groups = [{**group, "betas": tuple(group["betas"])} for group in state.param_groups]  # JSON made it a list
        tenant.optimizer.load_state_dict({"state": moments, "param_groups": groups})

    def unload(self, model_id: str) -> None:
        """Drop a tenant from memory (its state is on disk: the worker's live snapshot)."""
        with self._lock:
            tenant = self.tenants.pop(model_id)
        assert self.peft is not None  # a tenant existed
        self.peft.delete_adapter(tenant.adapter)
