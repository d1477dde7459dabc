"""Sampling: sampler weights, sampling sessions and `asample`, computed in this process with plain PyTorch on the
shared base model and an immutable snapshot of a tenant's adapter.

    POST /api/v1/save_weights_for_sampler  a future (queued in seq_id order, like save_weights): the adapter as
                                           tinker://MODEL_ID/sampler_weights/NAME; without a name (the SDK's
                                           save_weights_and_get_sampling_client) NAME is `sampling-session-N`
                                           and the result names the sampling session it opens
    POST /api/v1/create_sampling_session   a sampling session on a sampler_weights path or on the base model
    GET  /api/v1/samplers/ID               the session's base model and path (SamplingClient.create reads it)
    POST /api/v1/asample                   a future with one sample_sequence_id per sample; the result is the
                                           SDK's protobuf SampleResponse (it accepts no JSON for this type)

    CHECKPOINTS/MODEL_ID/sampler_weights/NAME/   adapter.safetensors (a LoRA weight version, as checkpoint.py's),
                                                 config.json (base model, LoraSpec, the saving request's id),
                                                 manifest.json; durable, no pickle
    tinker:sampling_session:ID                   hash: base_model, model_path ("" for the base model)

A snapshot is never overwritten (a second save under a name is refused), so a sampling session, which names one
path, sees exactly the weights it was created with however its training client trains on. Sampling sessions take
ids `SESSION:sample:N` from the SDK's per-session counter, and an asample is accepted once per (sampling session,
seq_id) like a training request (store.py), then runs on the worker thread in the order accepted.

Why a slot, not a model per snapshot: the worker binds a snapshot by copying its adapter tensors into a PEFT
adapter slot of the tenants' one PEFT model (one slot per rank, alpha and module set, reloaded only when another
snapshot is sampled), so sampling shares the base weights with training, costs an adapter's memory rather than a
model's, and computes exactly the function `forward` computes with the same tensors. The worker thread is the only
one that touches the model, so a sample never sees a half-trained adapter.

Generation: the prompt once through the model, then one token per step with its KV cache, the `num_samples` rows
as one batch. Each token is drawn with a torch.Generator seeded by `seed` (a request with a seed is reproducible;
without one, a fresh seed), from the logits divided by `temperature` (0: greedy) and cut to `top_k` (-1: all) and
`top_p`. A sample stops at `max_tokens` ("length"; without it, at the context length) or ("stop") at a stop token
or once its decoded text (special tokens skipped) contains a stop string; the stopping token is part of the
sample. `stop` None stops at EOS; [] never stops early. The log-probs returned (sampled tokens, and the prompt's
with `prompt_logprobs`, NaN at position 0 and before `prompt_logprobs_last_n`) are the model's log_softmax at
temperature 1, as `forward` returns them. Top-k log-probs, target prompt log-probs, alternative prompt tokens,
stability info and inflight sampler saves are refused by name. Sampling on the generators' engines (vLLM LoRA
requests) is the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fastapi import APIRouter, Request
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from pydantic import BaseModel
from safetensors.torch import save_file
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.types.checkpoint import ParsedCheckpointTinkerPath
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from reinforce.core.checkpoints import damage, write_manifest
from reinforce.core.durable import fsync_tree, replace_durably
from reinforce.core.lora import LORA_FORMAT, lora_config, read_lora_version
from reinforce.core.spec import LoraSpec
from reinforce.training_api.checkpoint import ADAPTER, CONFIG, NAME, saved_by
from reinforce.training_api.server import API, Accept, parse, read_body, refuse
from reinforce.training_api.store import PREFIX, FutureStore, Stored, session_of
from reinforce.training_api.tenants import PEFT_PREFIX, Tenants

KINDS = ("save_weights_for_sampler", "asample")
STOP = {"stop": public_pb.STOP_REASON_STOP, "length": public_pb.STOP_REASON_LENGTH}
REFUSED_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k")


def sampler_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/sampler_weights/{name}"


def unnamed(sampling_session_seq_id: int) -> str:
    """The snapshot name of a save without one (save_weights_and_get_sampling_client)."""
    return f"sampling-session-{sampling_session_seq_id}"


def sampling_session_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def sampling_session_key(sampling_session: str) -> str:
    return f"{PREFIX}sampling_session:{sampling_session}"


def sampler_folder(root: Path, path: str) -> Path:
    """The folder of a sampler_weights tinker:// path; ValueError naming `path`."""
    try:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError:
        raise ValueError(f"path {path!r} is not tinker://MODEL_ID/sampler_weights/NAME") from None
    if parsed.checkpoint_type != "sampler":
        raise ValueError(
            f"path {path!r}: sampling reads sampler weights (tinker://MODEL_ID/sampler_weights/NAME, from "
            "save_weights_for_sampler), not a training checkpoint"
        )
    name = parsed.checkpoint_id.removeprefix("sampler_weights/")
    if not NAME.fullmatch(name) or not NAME.fullmatch(parsed.training_run_id.replace(":", "_")):
        raise ValueError(f"path {path!r}: names are letters, digits, '_', '.' and '-'")
    return root / parsed.training_run_id / "sampler_weights" / name


def save_snapshot(
    root: Path, path: str, base_model: str, lora: LoraSpec, adapters: dict, run_id: str, request_id: str | None = None
) -> None:
    """Write sampler weights durably (staged, fsynced, renamed); ValueError where `path` exists: a snapshot is
    never replaced, so every sampling session on it keeps its weights. Where request `request_id` wrote it (replayed
    after a crash that came after the write) it is done already."""
    final = sampler_folder(root, path)
    if request_id is not None and saved_by(final) == request_id:
        return
    if final.exists():
        raise ValueError(f"sampler weights {path!r} exist already: a snapshot is saved once under a name")
    staging = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    scaling = repr(lora.alpha / lora.rank)
    save_file(adapters, str(staging / ADAPTER), metadata={"format": LORA_FORMAT, "lora_scaling": scaling})
    config = {"base_model": base_model, "lora": lora.model_dump(mode="json"), "request_id": request_id}
    (staging / CONFIG).write_text(json.dumps(config))
    write_manifest(staging, run_id)
    fsync_tree(staging)
    replace_durably(staging, final)


@dataclass(frozen=True)
class Snapshot:
    lora: LoraSpec
    adapters: dict[str, torch.Tensor]  # plain module names, `<module>.lora_{A,B}.weight`


def load_snapshot(root: Path, path: str, base_model: str) -> Snapshot:
    """ValueError naming the path where it is missing, damaged or of another base model."""
    folder = sampler_folder(root, path)
    if not folder.is_dir():
        raise ValueError(f"path {path!r}: no such sampler weights")
    if (problem := damage(folder)) is not None:
        raise ValueError(f"path {path!r}: {problem}")
    config = json.loads((folder / CONFIG).read_text())
    if config["base_model"] != base_model:
        raise ValueError(f"path {path!r}: weights of base model {config['base_model']!r}, not {base_model!r}")
    lora = LoraSpec.model_validate(config["lora"])
    adapters, _ = read_lora_version(folder / ADAPTER, lora.target_modules)
    return Snapshot(lora, adapters)


# ---- generation -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stops:
    tokens: frozenset[int]
    strings: tuple[str, ...]


def stops_of(stop: str | list | None, tokenizer: PreTrainedTokenizerBase) -> Stops:
    if stop is None:
        return Stops(frozenset([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else frozenset(), ())
    if isinstance(stop, str):
        return Stops(frozenset(), (stop,))
    return Stops(frozenset(s for s in stop if isinstance(s, int)), tuple(s for s in stop if isinstance(s, str)))


def draw(logits: torch.Tensor, params: types.SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `logits` [n, V]: greedy at temperature 0, else from softmax(logits / temperature) cut
    to the top_k most likely and the smallest set whose probability reaches top_p."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = scaled.topk(min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = scaled.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass ranked above each token
        ordered = ordered.masked_fill(before >= params.top_p, float("-inf"))  # the first always stays
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def stopped_by_string(tokens: list[int], stops: Stops, tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(stops.strings) and any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stops.strings)


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "length"


def generate(
    model: torch.nn.Module, prompt: list[int], n: int, params: types.SamplingParams, max_tokens: int,
    stops: Stops, tokenizer: PreTrainedTokenizerBase,
) -> tuple[list[Sequence], torch.Tensor]:  # fmt: skip
    """`n` samples of `prompt`, and the prompt's log-probs of each next token [len(prompt), V] (row i predicts
    token i + 1)."""
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    out = model(input_ids=torch.tensor([prompt] * n), use_cache=True)
    prompt_logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
    samples = [Sequence([], []) for _ in range(n)]
    logits = out.logits[:, -1].float()
    for step in range(max_tokens):
        tokens = draw(logits, params, generator)
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        for sample, token, logprob in zip(samples, tokens.tolist(), chosen.tolist(), strict=True):
            if sample.stop_reason == "length":  # a stopped row is computed on with the batch, its tokens dropped
                sample.tokens.append(token)
                sample.logprobs.append(logprob)
                if token in stops.tokens or stopped_by_string(sample.tokens, stops, tokenizer):
                    sample.stop_reason = "stop"
        if step == max_tokens - 1 or all(s.stop_reason == "stop" for s in samples):
            break
        out = model(input_ids=tokens[:, None], past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[:, -1].float()
    return samples, prompt_logprobs


def encode_samples(
    samples: list[Sequence], prompt: list[int], prompt_logprobs: torch.Tensor, request: types.SampleRequest
) -> bytes:
    """The SDK's protobuf SampleResponse."""
    sequences = [
        public_pb.SampledSequence(
            stop_reason=STOP[s.stop_reason],
            tokens=np.asarray(s.tokens, np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, np.float32).tobytes(),
        )
        for s in samples
    ]
    response = public_pb.SampleResponse(sequences=sequences)
    if request.prompt_logprobs:
        scores = np.full(len(prompt), np.nan, np.float32)
        scores[1:] = prompt_logprobs[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1).numpy()
        if request.prompt_logprobs_last_n is not None:
            scores[: len(prompt) - request.prompt_logprobs_last_n] = np.nan
        response.prompt_logprobs = scores.tobytes()
    return response.SerializeToString()


# ---- the worker's side ------------------------------------------------------------------------------------------


class Sampler:
    """Saves snapshots and samples; only the worker thread calls it (it shares the tenants' model)."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants
        self.slots: dict[str, str] = {}  # a LoraSpec's JSON -> its PEFT adapter slot
        self.bound: dict[str, str] = {}  # a slot -> the sampler path whose tensors it holds
        self.slot_of: dict[str, str] = {}  # a sampler path -> the slot of its LoraSpec
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.tenants.base_dir)
        return self._tokenizer

    def apply(self, request: Stored) -> tuple[bytes, str]:
        """(result, result_type) of an accepted request of one of KINDS; ValueError where it cannot be applied."""
        if request.kind == "asample":
            return self.sample(types.SampleRequest.model_validate_json(request.body)), "proto"
        save = types.SaveWeightsForSamplerRequest.model_validate_json(request.body)
        saved = self.save(request.model_id, save, request.request_id)
        return saved.model_dump_json(exclude_none=True).encode(), "json"

    def save(self, model_id: str, save: types.SaveWeightsForSamplerRequest, request_id: str | None = None) -> BaseModel:
        tenant = self.tenants.tenants.get(model_id)
        if tenant is None or self.tenants.peft is None:
            raise ValueError(f"model_id {model_id!r}: no such model on this server")
        adapters = {
            name.removeprefix(PEFT_PREFIX): tensor.detach().clone()
            for name, tensor in get_peft_model_state_dict(
                self.tenants.peft, adapter_name=tenant.adapter, save_embedding_layers=False
            ).items()
        }
        seq = save.sampling_session_seq_id
        path = sampler_path(model_id, save.path if save.path is not None else unnamed(seq or 0))
        tenants = self.tenants
        save_snapshot(tenants.checkpoints, path, tenants.base_model, tenant.lora, adapters, tenants.run_id, request_id)
        opened = sampling_session_id(session_of(model_id), seq) if save.path is None and seq is not None else None
        return types.SaveWeightsForSamplerResponseInternal(
            path=path, sampling_session_id=opened, type="save_weights_for_sampler"
        )

    def sample(self, request: types.SampleRequest) -> bytes:
        prompt = request.prompt.to_ints()
        max_tokens = request.sampling_params.max_tokens or self.tenants.max_context_length - len(prompt)
        stops = stops_of(request.sampling_params.stop, self.tokenizer)  # type: ignore[arg-type]
        with torch.no_grad(), self._bound(request.model_path or None) as model:
            samples, prompt_logprobs = generate(
                model, prompt, request.num_samples, request.sampling_params, max_tokens, stops, self.tokenizer
            )
        return encode_samples(samples, prompt, prompt_logprobs, request)

    @contextlib.contextmanager
    def _bound(self, path: str | None) -> Iterator[torch.nn.Module]:
        """The model with `path`'s snapshot bound (None: the base model, every adapter off)."""
        peft = self.tenants.peft
        if path is None and peft is None:
            yield self.tenants.plain
        elif path is None:
            assert peft is not None
            with peft.disable_adapter():
                yield peft
        else:
            slot = self._bind(path)
            assert self.tenants.peft is not None  # _bind made one
            self.tenants.peft.set_adapter(slot)  # each tenant activates its own before each of its requests
            yield self.tenants.peft

    def _bind(self, path: str) -> str:
        """The slot holding `path`'s tensors, copied in (after a check against its manifest) unless it holds them."""
        slot = self.slot_of.get(path)
        if slot is not None and self.bound[slot] == path:
            return slot
        snapshot = load_snapshot(self.tenants.checkpoints, path, self.tenants.base_model)
        slot = self._slot(snapshot.lora)
        assert self.tenants.peft is not None  # _slot made one
        named = {PEFT_PREFIX + name: tensor for name, tensor in snapshot.adapters.items()}
        set_peft_model_state_dict(self.tenants.peft, named, adapter_name=slot)
        self.bound[slot], self.slot_of[path] = path, slot
        return slot

    def _slot(self, lora: LoraSpec) -> str:
        key = lora.model_dump_json()
        if key not in self.slots:
            slot = f"sampler{len(self.slots)}"
            config = lora_config(self.tenants.plain, lora)
            with torch.random.fork_rng(devices=[]):  # its initial values are overwritten; keep the process's RNG
                if self.tenants.peft is None:
                    self.tenants.peft = get_peft_model(self.tenants.plain, config, adapter_name=slot)
                else:
                    self.tenants.peft.add_adapter(slot, config)
            self.slots[key] = slot
        return self.slots[key]


# ---- the server's side ------------------------------------------------------------------------------------------


def check_sample(sample: types.SampleRequest, vocab_size: int, max_context_length: int) -> None:
    """ValueError naming the field of an asample this server cannot compute."""
    for field in REFUSED_FIELDS:
        if getattr(sample, field):
            raise ValueError(f"{field} is not supported in this version of the reinforce training API")
    if sample.record_stability_info:
        raise ValueError("record_stability_info (StableReinforce) is not supported in this version")
    prompt = sample.prompt.to_ints()  # ValueError for image chunks
    if not prompt:
        raise ValueError("prompt: no tokens")
    if bad := [t for t in prompt if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt: token {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if sample.num_samples < 1:
        raise ValueError(f"num_samples {sample.num_samples}: at least 1")
    params = sample.sampling_params
    if params.max_tokens is not None and params.max_tokens < 1:
        raise ValueError(f"sampling_params.max_tokens {params.max_tokens}: at least 1")
    if len(prompt) + (params.max_tokens or 1) > max_context_length:
        raise ValueError(f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed {max_context_length}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError("sampling_params: temperature must be >= 0 and top_p in (0, 1]")
    last_n = sample.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
        raise ValueError(f"prompt_logprobs_last_n {last_n}: between 1 and {len(prompt) - 1}")


def checked_save(root: Path, save: types.SaveWeightsForSamplerRequest) -> str:
    """The sampler path a save_weights_for_sampler writes; ValueError where this version cannot save it."""
    if save.kind != "snapshot":
        raise ValueError("save_weights_for_sampler: kind 'inflight' is not supported in this version (snapshot)")
    if save.path is None and save.sampling_session_seq_id is None:
        raise ValueError("save_weights_for_sampler: a path (the name) or a sampling_session_seq_id")
    path = sampler_path(save.model_id, save.path or unnamed(save.sampling_session_seq_id or 0))
    sampler_folder(root, path)
    return path


def routes(tenants: Tenants, store: FutureStore, accept: Accept) -> APIRouter:
    """The sampling routes; `accept` is the server's, which takes a request once per (model, seq_id)."""
    router = APIRouter()

    async def held_path(sampling_session: str) -> str:
        """The session's sampler path ("" for the base model); 404 for an unknown session."""
        held = await store.redis.hget(sampling_session_key(sampling_session), "model_path")
        if held is None:
            raise refuse(404, f"sampling_session_id {sampling_session!r}: no such sampling session")
        return held.decode()

    async def register(sampling_session: str, model_path: str) -> None:
        """Open a sampling session on `model_path` once; 409 for the same id on another path."""
        key = sampling_session_key(sampling_session)
        if not await store.redis.hsetnx(key, "model_path", model_path) and await held_path(sampling_session) != (
            model_path
        ):
            raise refuse(409, f"sampling session {sampling_session} exists on another model_path")

    @router.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        body = await read_body(request)
        save = parse(body, types.SaveWeightsForSamplerRequest)
        try:
            path = checked_save(tenants.checkpoints, save)
        except ValueError as err:
            if save.seq_id:  # the worker must not wait for a request refused here
                await store.refused(save.model_id, save.seq_id)
            raise refuse(400, str(err)) from None
        if not await store.created(save.model_id):
            raise refuse(404, f"model_id {save.model_id!r}: no such model")
        future = await accept(save.model_id, save.seq_id, "save_weights_for_sampler", body, "", save)
        if save.path is None and save.sampling_session_seq_id is not None:
            # the session the result names, on the path the worker writes (the SDK samples once the save is done)
            await register(sampling_session_id(session_of(save.model_id), save.sampling_session_seq_id), path)
        return future

    @router.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        ask = parse(await read_body(request), types.CreateSamplingSessionRequest)
        found = await store.session(ask.session_id)
        if not found or b"finished" in found:
            raise refuse(404, f"session_id {ask.session_id!r}: no such open session")
        if ask.base_model not in (None, tenants.base_model):
            raise refuse(400, f"base_model {ask.base_model!r}: this server samples {tenants.base_model!r}")
        if ask.model_path is None and ask.base_model is None:
            raise refuse(400, "create_sampling_session: a model_path or a base_model")
        if ask.model_path is not None:
            try:
                await asyncio.to_thread(load_snapshot, tenants.checkpoints, ask.model_path, tenants.base_model)
            except ValueError as err:
                raise refuse(400, str(err)) from None
        sampling_session = sampling_session_id(ask.session_id, ask.sampling_session_seq_id)
        await register(sampling_session, ask.model_path or "")
        return types.CreateSamplingSessionResponse(sampling_session_id=sampling_session).model_dump()

    @router.get(f"{API}/samplers/{{sampling_session}}")
    async def get_sampler(sampling_session: str) -> dict:
        path = await held_path(sampling_session)
        return types.GetSamplerResponse(
            sampler_id=sampling_session, base_model=tenants.base_model, model_path=path or None
        ).model_dump()

    @router.post(f"{API}/asample")
    async def asample(request: Request) -> dict:
        sample = parse(await read_body(request), types.SampleRequest)
        if sample.sampling_session_id is None or sample.seq_id is None:
            raise refuse(400, "asample: sampling_session_id and seq_id are required (a SamplingClient sends both)")
        path = await held_path(sample.sampling_session_id)
        try:
            check_sample(sample, tenants.vocab_size, tenants.max_context_length)
        except ValueError as err:
            raise refuse(400, f"asample: {err}") from None
        resolved = sample.model_copy(update={"model_path": path or None, "base_model": tenants.base_model})
        body = resolved.model_dump_json().encode()
        future = await accept(sample.sampling_session_id, sample.seq_id, "asample", body, "", resolved)
        return {**future, "sample_sequence_ids": [f"{future['request_id']}:{i}" for i in range(sample.num_samples)]}

    return router
