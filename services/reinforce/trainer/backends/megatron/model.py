"""The Megatron-core policy: parallel setup, loading HF weights, response log-probs, gathering back to HF.

`response_logprobs` here has the signature and semantics of `reinforce.trainer.logprobs.response_logprobs` (the
torch trainer's): log_softmax(logits / temperature) of each response token, (logprobs [B, T], mask [B, T]),
right-padded, differentiable. With tensor parallelism each rank holds a slice of the vocabulary; the
log-softmax is computed across the slices by Megatron's `vocab_parallel_cross_entropy` (no rank ever
materialises the full-vocabulary logits), and its backward is the exact softmax gradient per slice. Nor does a
rank hold its slice's logits of every response token at once: the output layer runs over chunks of response
positions, forward and backward (reinforce.trainer.chunked_head, as the torch trainer's head does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from transformers import LlamaConfig

from reinforce.core.response_states import check_sequences, padded_like, response_positions, right_padded
from reinforce.trainer.backends.megatron.convert import (
    LlamaLayout,
    StateDict,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
)
from reinforce.trainer.backends.megatron.cpu_shim import apply_cpu_shim
from reinforce.trainer.chunked_head import chunked_outputs, head_chunk_rows, temperature_scaled

_EXTRA_STATE = "_extra_state"


# ---- process groups ----------------------------------------------------------------------------------------


def initialize_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, seed: int = 0) -> None:
    """torch.distributed (from torchrun's environment, or a one-process group) and Megatron's parallel state.

    gloo on CPU (the shim is applied first), NCCL on GPU. Data parallelism is what is left of the world size.
    Idempotent for the same sizes.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_shim()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            # One process without torchrun (tests, a single-rank trainer): an in-memory store needs no port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (tensor_parallel_size, pipeline_parallel_size):
            raise RuntimeError(f"parallel state already set up with TP={tp}, PP={pp}")
    else:
        parallel_state.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Undo :func:`initialize_parallel` (tests build several configurations in one process)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


# ---- weights in and out ------------------------------------------------------------------------------------


def read_hf_folder(folder: str | Path) -> tuple[LlamaConfig, StateDict]:
    """The config and the safetensors weights of a Hugging Face folder (as materialize_policy writes it).

    Reads the tensors directly: no HF model is built, so a large policy is not held twice in memory.
    """
    folder = Path(folder)
    config = LlamaConfig.from_pretrained(folder, local_files_only=True)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: StateDict = {}
    for name in files:
        state.update(load_file(folder / name))
    return config, state


def megatron_state_dict(model: torch.nn.Module) -> StateDict:
    """The model's tensors by name, without Megatron's `_extra_state` placeholders (None with the local spec)."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, Tensor)}


def load_megatron_state_dict(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load tensors (this rank's shard) strictly; `_extra_state` entries the model expects are given as None."""
    full: dict[str, Any] = dict(state)
    for key in model.state_dict():
        if key.endswith(_EXTRA_STATE) and key not in full:
            full[key] = None
    model.load_state_dict(full, strict=True)


def load_hf_state_dict(model: torch.nn.Module, hf_state: StateDict, layout: LlamaLayout) -> None:
    """Load an HF Llama state dict into this tensor-parallel rank's GPTModel."""
    rank, world = tensor_parallel_rank_and_size()
    load_megatron_state_dict(model, hf_to_megatron_shard(hf_state, layout, rank, world))


def gather_tensor_parallel_shards(local: StateDict) -> list[StateDict] | None:
    """Every tensor-parallel rank's `local` tensors (same names and shapes on each), in rank order, on the TP
    group's first rank; None on the others. Every rank of the group must call it.

    One flat gather rather than one per tensor: few, large messages.
    """
    from megatron.core import parallel_state

    rank, world = tensor_parallel_rank_and_size()
    if world == 1:
        return [dict(local)]
    names = sorted(local)
    tensors = [local[n].detach().contiguous() for n in names]
    flat = _flatten_dense_tensors(tensors)
    group = parallel_state.get_tensor_model_parallel_group()
    gathered = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    dist.gather(flat, gathered, dst=dist.get_global_rank(group, 0), group=group)
    if gathered is None:
        return None
    return [dict(zip(names, _unflatten_dense_tensors(g, tensors), strict=True)) for g in gathered]


def gather_hf_state_dict(model: torch.nn.Module, layout: LlamaLayout) -> StateDict | None:
    """All tensor-parallel shards -> one HF state dict on the TP group's first rank (None on the others).

    Every rank of the group must call it. Publishing is then rank 0's job (the first TP rank of the first
    data-parallel replica).
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("gathering pipeline stages is not implemented (CPU runs use PP=1)")
    shards = gather_tensor_parallel_shards(megatron_state_dict(model))
    return None if shards is None else megatron_shards_to_hf(shards, layout)


# ---- log-probs -------------------------------------------------------------------------------------------


@contextmanager
def _hidden_states_only(model: Any) -> Iterator[None]:
    # GPTModel.forward returns the decoder output (final norm applied) instead of logits when post_process is
    # False. We want the LM head on the response positions only (as the torch trainer does), so switch it off
    # for this call and apply the output layer ourselves.
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


def _response_states(
    model: Any, prompt_ids: list[list[int]], response_ids: list[list[int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """(the final hidden states that predict each real response token [N, H]; the tokens [N]; the [B, T] mask)."""
    check_sequences(prompt_ids, response_ids)
    if not model.pre_process or not model.post_process:
        raise NotImplementedError("log-probs need the whole model on this rank (pipeline parallelism is not wired)")
    device = next(model.parameters()).device
    input_ids = right_padded(prompt_ids, response_ids, pad=0)[0].to(device)  # pad id 0: never attended
    # Right padding and a causal mask: a real token never attends to padding, so no attention mask is needed
    # (Megatron builds the causal one); positions are a plain arange for every row.
    positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    embedded = model.embedding(input_ids=input_ids, position_ids=positions)  # [S, B, H]
    if model.padding_idx is not None:
        # HF's Llama embeds with nn.Embedding(padding_idx=pad_token_id): a lookup of the pad token (a sampled
        # response may hold it) passes no gradient to that row. The same here, or the two backends train apart.
        lookups_of_pad = (input_ids == model.padding_idx).t().unsqueeze(-1)
        embedded = torch.where(lookups_of_pad, embedded.detach(), embedded)
    with _hidden_states_only(model):
        hidden = model(input_ids=input_ids, position_ids=positions, attention_mask=None, decoder_input=embedded)
    rows, cols, targets, mask = response_positions(prompt_ids, response_ids, device)
    return hidden[cols, rows], targets, mask


def _head_outputs(
    model: Any, states: Tensor, targets: Tensor, temperature: float, vocab_size: int | None, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / temperature) at each target [N] and, if `entropy`, each row's entropy [N], the logits
    being the output layer's of `states` [N, H] over the whole (unpadded) vocabulary: this rank's slice, reduced
    across the slices. Computed over chunks of rows, each [rows, V/t] logits held alone, forward and backward; the
    rows are :func:`head_chunk_rows` of the slice width, the same on every rank, so every rank runs the same
    collectives in the same order."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    tied = model.share_embeddings_and_output_weights
    # [V_padded / t, H]: the output layer's own weight or, tied, the embedding's, which it is given.
    weight = model.shared_embedding_or_output_weight()
    given = weight if tied else None
    vocab_size = vocab_size or model.unpadded_vocab_size

    def outputs(chunk_states: Tensor, chunk_targets: Tensor) -> tuple[Tensor, Tensor | None]:
        logits, _ = model.output_layer(chunk_states.unsqueeze(1), weight=given)  # Megatron's linears take [s, b, h]
        logits = _mask_padded_vocab(temperature_scaled(logits.squeeze(1), temperature), vocab_size)
        # The entropy first: vocab_parallel_cross_entropy overwrites its input with the softmax (in place).
        entropies = _vocab_parallel_entropy(logits) if entropy else None
        # -log_softmax at the target, its max and sum-exp reduced over the TP ranks.
        return -vocab_parallel_cross_entropy(logits, chunk_targets), entropies

    # What the head trains, to get its gradients from the chunks: the output layer's parameters, or the tied weight.
    params = [p for p in ([weight] if tied else model.output_layer.parameters()) if p.requires_grad]
    return chunked_outputs(outputs, states, targets, params, head_chunk_rows(weight.shape[0]))


def response_logprobs(
    model: Any,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    temperature: float,
    *,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """log pi(y_t | x, y_<t) = log_softmax(logits / temperature) for every response token, with a GPTModel.

    Same contract as reinforce.trainer.logprobs.response_logprobs: (logprobs [B, T], mask [B, T]) right-padded to
    the longest response, mask 1.0 on real tokens, differentiable when grad is enabled. Every rank of a
    tensor-parallel group must call it with the same batch. `vocab_size` (default: the model's
    `unpadded_vocab_size`, set by build_gpt_model) excludes Megatron's padded vocabulary rows from the softmax.
    """
    states, targets, mask = _response_states(model, prompt_ids, response_ids)
    logprobs, _ = _head_outputs(model, states, targets, temperature, vocab_size, entropy=False)
    return padded_like(mask, logprobs), mask


def response_logprobs_and_entropy(
    model: Any, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs as :func:`response_logprobs`, each token's distribution's entropy, mask), all [B, T]: the
    contract of reinforce.trainer.logprobs.response_logprobs_and_entropy."""
    states, targets, mask = _response_states(model, prompt_ids, response_ids)
    logprobs, entropy = _head_outputs(model, states, targets, temperature, None, entropy=True)
    return padded_like(mask, logprobs), padded_like(mask, entropy), mask


def _vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """H = log S - sum_v e_v (z_v - m) / S with e_v = exp(z_v - m), S = sum_v e_v, over every rank's slice [N].

    The sums are all-reduced forward with an identity backward (Megatron's reduce_from_tensor_model_parallel):
    H is replicated on every rank, so each rank's slice gets the whole gradient of its own terms.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    peak = logits.detach().max(dim=-1).values
    if tensor_parallel_rank_and_size()[1] > 1:
        from megatron.core import parallel_state

        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - peak[:, None]
    exp = shifted.exp()
    # Padded vocabulary columns are -inf: their e is 0, and 0 * -inf would be NaN, so they add 0 explicitly.
    weighted = exp * shifted.masked_fill(torch.isinf(shifted), 0.0)
    sums = reduce_from_tensor_model_parallel_region(torch.stack([exp.sum(-1), weighted.sum(-1)], dim=-1))
    return sums[:, 0].log() - sums[:, 1] / sums[:, 0]


def _mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """-inf on this rank's padded vocabulary columns (ids >= vocab_size), so they get no probability."""
    rank, _ = tensor_parallel_rank_and_size()
    width = logits.shape[-1]
    start = rank * width
    if start + width <= vocab_size:
        return logits
    ids = torch.arange(start, start + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


# ---- gradients ---------------------------------------------------------------------------------------------


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model-parallel model; returns the total norm.

    Sharded parameters contribute their shard on every rank; replicated ones (norms) are counted once, on
    tensor-parallel rank 0, so the norm equals the unsharded model's.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    pairs = [(p, p.grad) for p in parameters if p.grad is not None]
    device = pairs[0][1].device if pairs else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for param, grad in pairs:
        if param_is_not_tensor_parallel_duplicate(param):
            squares += grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    total = squares.sqrt()
    # Same formula as torch: scale by min(1, max_norm / (norm + 1e-6)), applied even when it is 1.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for _, grad in pairs:
        grad.detach().mul_(coef.to(grad.dtype))
    return total
