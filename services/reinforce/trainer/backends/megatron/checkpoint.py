"""Sharded checkpoints of the Megatron policy: each rank writes its own shard, any TP size can read it back.

    <folder>/
        megatron.json                    sizes, layout, optimizer hyper-parameters, scheduler state
        model-tp00-pp00.safetensors      one per (TP rank, PP rank): that rank's parameters
        optim-tp00-pp00.safetensors      that rank's Adam state by parameter name: NAME/exp_avg, NAME/exp_avg_sq, ...
        rng-rank00000.safetensors        one per global rank: CPU (and CUDA) RNG and Megatron's RNG tracker

Only data-parallel rank 0 writes model and optimizer files (the replicas are identical: the optimizer is not
distributed). Everything is safetensors or JSON: loading never unpickles. The optimizer state is stored by
parameter name, shaped like the parameter shard, so the functions that reshard parameters (convert.py) reshard
Adam's moments too: a checkpoint written with TP=2 loads into TP=1 (or 4) exactly.

Every rank writes into the same folder, on storage every rank sees; the trainer (trainer/checkpoint.py) hands
it a temporary folder and renames it once every rank has written, so a crash never leaves one that looks complete.
Its manifest there covers every shard: a resume checks each one's sha256 before any rank loads it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from reinforce.trainer.backends.megatron.convert import LlamaLayout, StateDict, merge_tensor, shard_tensor
from reinforce.trainer.backends.megatron.model import load_megatron_state_dict, megatron_state_dict

FORMAT_VERSION = 1
META = "megatron.json"
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _ranks() -> tuple[int, int, int, int, int]:
    """(global rank, TP rank, TP size, PP rank, DP rank)."""
    from megatron.core import parallel_state as ps

    return (
        dist.get_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )


def _shard_name(kind: str, tp_rank: int, pp_rank: int) -> str:
    return f"{kind}-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def _contiguous(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    # safetensors wants contiguous tensors that share no storage; clone() gives both.
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


# ---- optimizer state by parameter name ----------------------------------------------------------------------


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[StateDict, list]:
    """(tensors "NAME/KEY" of each parameter's state, param groups' hyper-parameters with parameter names)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: StateDict = {}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, Tensor):
                    raise TypeError(f"optimizer state {names[id(p)]}/{key} is not a tensor ({type(value).__name__})")
                tensors[f"{names[id(p)]}/{key}"] = value
    return tensors, groups


def load_optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: StateDict, groups: list
) -> None:
    """Inverse of :func:`optimizer_state_by_name`, into an optimizer built over the same parameters."""
    params = dict(model.named_parameters())
    index: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[id(p)] = len(index)
    state: dict[int, dict[str, Tensor]] = {}
    for flat_name, value in tensors.items():
        name, key = flat_name.rsplit("/", 1)
        state.setdefault(index[id(params[name])], {})[key] = value
    param_groups = []
    for saved, current in zip(groups, optimizer.param_groups, strict=True):
        restored = {k: tuple(v) if isinstance(current.get(k), tuple) else v for k, v in saved.items()}
        restored["params"] = [index[id(params[n])] for n in saved["params"]]
        param_groups.append(restored)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ---- RNG -----------------------------------------------------------------------------------------------------


def _rng_state() -> StateDict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    out.update({f"tracker/{k}": v for k, v in get_cuda_rng_tracker().get_states().items()})
    return out


def _set_rng_state(state: StateDict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = {k.removeprefix("tracker/"): v for k, v in state.items() if k.startswith("tracker/")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


# ---- save / load ---------------------------------------------------------------------------------------------


def save_sharded_checkpoint(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: LlamaLayout,
    scheduler: Any | None = None,
) -> None:
    """Every rank calls this with the same existing `folder` and writes its part."""
    folder = Path(folder)
    rank, tp_rank, tp_size, pp_rank, dp_rank = _ranks()
    tensors, groups = optimizer_state_by_name(model, optimizer)
    if dp_rank == 0:
        save_file(_contiguous(megatron_state_dict(model)), folder / _shard_name("model", tp_rank, pp_rank))
        save_file(_contiguous(tensors), folder / _shard_name("optim", tp_rank, pp_rank))
    save_file(_contiguous(_rng_state()), folder / f"rng-rank{rank:05d}.safetensors")
    if rank == 0:
        from megatron.core import parallel_state as ps

        meta = {
            "format": FORMAT_VERSION,
            "tensor_parallel_size": tp_size,
            "pipeline_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "world_size": dist.get_world_size(),
            "layout": dataclasses.asdict(layout),
            "param_groups": groups,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        (folder / META).write_text(json.dumps(meta, indent=1))


def _reshard(
    name: str, shards: list[Tensor], saved: LlamaLayout, current: LlamaLayout, rank: int, world: int
) -> Tensor:
    """A tensor saved over len(shards) TP ranks -> rank `rank` of `world`, vocabulary padding adjusted.

    `name` is a parameter's name, or "NAME/KEY" for its optimizer state (sharded like the parameter).
    """
    name = name.split("/", 1)[0]
    full = merge_tensor(name, shards)
    if name.endswith(_VOCAB_ROWS) and full.dim() > 0:
        # Padding rows differ between TP sizes; they hold zeros (never looked up, masked out of the softmax).
        rows = full.new_zeros((current.padded_vocab_size, *full.shape[1:]))
        rows[: saved.vocab_size] = full[: saved.vocab_size]
        full = rows
    return shard_tensor(name, full, rank, world)


def _read_shards(folder: Path, kind: str, meta: dict, layout: LlamaLayout, tp_rank: int, tp_size: int) -> StateDict:
    from megatron.core import parallel_state as ps

    pp_rank = ps.get_pipeline_model_parallel_rank()
    if meta["tensor_parallel_size"] == tp_size:
        return load_file(folder / _shard_name(kind, tp_rank, pp_rank))
    saved_layout = LlamaLayout(**meta["layout"])
    shards = [load_file(folder / _shard_name(kind, r, pp_rank)) for r in range(meta["tensor_parallel_size"])]
    return {
        name: _reshard(name, [s[name] for s in shards], saved_layout, layout, tp_rank, tp_size) for name in shards[0]
    }


def load_sharded_checkpoint(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layout: LlamaLayout,
    scheduler: Any | None = None,
) -> dict[str, Any]:
    """Load this rank's model (and optimizer, scheduler, RNG) from `folder`; returns the metadata.

    A different tensor-parallel size than the one saved is resharded on the fly; the RNG state is restored
    only when the world is the same (otherwise there is no rank-to-rank correspondence to keep).
    """
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    if meta["format"] != FORMAT_VERSION:
        raise ValueError(f"{folder}: checkpoint format {meta['format']}, expected {FORMAT_VERSION}")
    from megatron.core import parallel_state as ps

    if meta["pipeline_parallel_size"] != ps.get_pipeline_model_parallel_world_size():
        raise NotImplementedError("changing the pipeline-parallel size on load is not supported")
    rank, tp_rank, tp_size, _, _ = _ranks()
    load_megatron_state_dict(model, _read_shards(folder, "model", meta, layout, tp_rank, tp_size))
    if optimizer is not None:
        tensors = _read_shards(folder, "optim", meta, layout, tp_rank, tp_size)
        load_optimizer_state_by_name(model, optimizer, tensors, meta["param_groups"])
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if meta["world_size"] == dist.get_world_size():
        _set_rng_state(load_file(folder / f"rng-rank{rank:05d}.safetensors"))
    return meta
