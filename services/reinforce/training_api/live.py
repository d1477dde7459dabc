"""Live snapshots: each model's whole state after the last request applied to it, so that an API process killed
with -9 comes back exactly where it was.

    CHECKPOINTS/MODEL_ID/live/
        live.json               the last applied request (seq_id, request id, its outcome: the result, or the
                                failure), the model's LoraSpec, its AdamW param groups, the tensor file below, and
                                `expired` (the error its requests get) once its session expired and it was unloaded
        tensors-SEQ.safetensors `param.I` (the adapter), `grad.I` (gradients added by forward_backward and not yet
                                stepped), `optim.I.KEY` (AdamW's exp_avg, exp_avg_sq, step); I is the tenant's fixed
                                parameter order

The worker writes one after every request it applies to a model, done or failed, before it records the outcome in
Redis: the tensors under a new name first, then live.json by temp file and rename (each fsynced), so a crash at any
point leaves the previous pair whole, and the outcome of a request whose snapshot was written but whose Redis
record was not is in live.json. A request that changes no tensor (a forward, save_weights, save_weights_for_sampler)
rewrites live.json alone, naming the tensor file it had. Cost: the adapter, its gradients and its two AdamW moments
written once per request, about four times the adapter's size (kilobytes for the tiny test models, tens of MB for
a rank-32 adapter of a 1B model): sane for the small models this serves; a large one would want a snapshot every N
requests and a replay from the requests Redis keeps. No pickle: safetensors and JSON.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reinforce.core.durable import fsync_path, replace_durably, write_text_atomically
from reinforce.core.spec import LoraSpec

LIVE, INDEX = "live", "live.json"


@dataclass(frozen=True)
class Outcome:
    """What a request came to: done with a result (result_type proto | json), or failed with an error and the
    SDK's RequestErrorCategory (user | server)."""

    status: str
    result: bytes = b""
    result_type: str = ""
    error: str = ""
    category: str = ""

    @classmethod
    def done(cls, result: bytes, result_type: str) -> Outcome:
        return cls("done", result=result, result_type=result_type)

    @classmethod
    def failed(cls, error: str, category: str) -> Outcome:
        return cls("failed", error=error, category=category)

    def to_json(self) -> dict:
        return {**self.__dict__, "result": base64.b64encode(self.result).decode()}

    @classmethod
    def from_json(cls, data: dict) -> Outcome:
        return cls(**{**data, "result": base64.b64decode(data["result"])})


@dataclass(frozen=True)
class ModelState:
    """A tenant's state as the worker captures and restores it (tenants.py)."""

    lora: LoraSpec
    param_groups: list[dict]  # AdamW's state_dict()["param_groups"], JSON as they are (betas a list)
    tensors: dict[str, torch.Tensor]  # param.I, grad.I, optim.I.KEY


@dataclass(frozen=True)
class Snapshot:
    model_id: str
    seq_id: int  # of the last request applied
    request_id: str
    outcome: Outcome
    state: ModelState
    expired: str | None = None  # the error a request on the model gets once its session expired


def folder_of(root: Path, model_id: str) -> Path:
    return root / model_id / LIVE


def _tensor_file(seq_id: int) -> str:
    return f"tensors-{seq_id}.safetensors"


def _write_tensors(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    tmp = folder / f".{name}.tmp"
    save_file({key: value.detach().contiguous() for key, value in tensors.items()}, str(tmp))
    fsync_path(tmp)
    replace_durably(tmp, folder / name)


def _index(snapshot: Snapshot, tensors: str) -> dict:
    return {
        "model_id": snapshot.model_id, "seq_id": snapshot.seq_id, "request_id": snapshot.request_id,
        "outcome": snapshot.outcome.to_json(), "lora": snapshot.state.lora.model_dump(mode="json"),
        "param_groups": snapshot.state.param_groups, "tensors": tensors, "expired": snapshot.expired,
    }  # fmt: skip


def write(root: Path, snapshot: Snapshot, tensors_changed: bool = True) -> None:
    """Replace the model's live snapshot. tensors_changed False: the request left every tensor as it was, so the
    tensor file already there is reused (where there is one)."""
    folder = folder_of(root, snapshot.model_id)
    folder.mkdir(parents=True, exist_ok=True)
    previous = _read_index(folder)
    if tensors_changed or previous is None:
        name = _tensor_file(snapshot.seq_id)
        _write_tensors(folder, name, snapshot.state.tensors)
    else:
        name = previous["tensors"]
    write_text_atomically(folder / INDEX, json.dumps(_index(snapshot, name)))
    for stale in folder.glob("tensors-*.safetensors"):  # files of earlier snapshots, or of a crashed write
        if stale.name != name:
            stale.unlink(missing_ok=True)


def mark_expired(root: Path, model_id: str, message: str) -> None:
    """Record in the model's live snapshot that its session expired (its tensors stay as they are)."""
    folder = folder_of(root, model_id)
    index = _read_index(folder)
    if index is not None:
        write_text_atomically(folder / INDEX, json.dumps({**index, "expired": message}))


def _read_index(folder: Path) -> dict | None:
    path = folder / INDEX
    return json.loads(path.read_text()) if path.is_file() else None


def read(folder: Path) -> Snapshot | None:
    """The snapshot in a live/ folder; None where there is none."""
    index = _read_index(folder)
    if index is None:
        return None
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / index["tensors"]), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            tensors[key] = f.get_tensor(key)
    state = ModelState(LoraSpec.model_validate(index["lora"]), index["param_groups"], tensors)
    return Snapshot(
        index["model_id"], index["seq_id"], index["request_id"], Outcome.from_json(index["outcome"]), state,
        index["expired"],
    )  # fmt: skip


def snapshots(root: Path) -> list[Snapshot]:
    """Every model's live snapshot under `root`, in the order of their model ids."""
    if not root.is_dir():
        return []
    found = (read(folder) for folder in sorted(root.glob(f"*/{LIVE}")) if folder.is_dir())
    return [snapshot for snapshot in found if snapshot is not None]


def remove_temporaries(root: Path) -> None:
    """Temp files a crash left mid-write (they never replaced anything)."""
    for tmp in root.glob(f"*/{LIVE}/.*.tmp"):
        os.unlink(tmp)
