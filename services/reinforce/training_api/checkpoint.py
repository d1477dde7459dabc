"""save_weights / load_weights: a model's adapter and AdamW state as a durable folder behind a tinker:// path.

    tinker://MODEL_ID/weights/NAME  ->  CHECKPOINTS/MODEL_ID/weights/NAME/
        adapter.safetensors    the adapters as a LoRA weight version (core/lora.py: plain module names, metadata
                               `format: lora` and `lora_scaling`), the file the generators load
        optimizer.safetensors  AdamW's state, `<parameter index>.<exp_avg|exp_avg_sq|step>` (the tenant's fixed order)
        config.json            the base model, the adapters' LoraSpec (rank, alpha, modules) and the id of the
                               request that saved it (a replay of that request after a crash finds it done)
        manifest.json          core/checkpoints.py's: the run's id and each file's size and sha256

Written into a staging folder, fsynced and renamed into place (core/durable.py), so a crash leaves the old
checkpoint or the new one; a load checks every file against the manifest first. No pickle anywhere: safetensors
and JSON only.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tinker.types.checkpoint import ParsedCheckpointTinkerPath

from reinforce.core.checkpoints import damage, write_manifest
from reinforce.core.durable import fsync_tree, replace_durably
from reinforce.core.lora import LORA_FORMAT, read_lora_version
from reinforce.core.spec import LoraSpec

ADAPTER, OPTIMIZER, CONFIG = "adapter.safetensors", "optimizer.safetensors", "config.json"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # one path segment, never `..` or hidden


@dataclass(frozen=True)
class State:
    base_model: str
    lora: LoraSpec
    adapters: dict[str, torch.Tensor]  # `<module>.lora_{A,B}.weight`
    optimizer: dict[int, dict[str, torch.Tensor]]  # AdamW's state_dict()["state"]
    num_parameters: int


def tinker_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/weights/{name}"


def folder_of(root: Path, path: str) -> Path:
    """The folder of a training checkpoint's tinker:// path (the SDK's own parser); ValueError naming `path`."""
    try:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError:
        raise ValueError(f"path {path!r} is not tinker://MODEL_ID/weights/NAME") from None
    if parsed.checkpoint_type != "training":
        raise ValueError(f"path {path!r}: only training checkpoints (weights/) are kept by this version")
    name = parsed.checkpoint_id.removeprefix("weights/")
    if not NAME.fullmatch(name) or not NAME.fullmatch(parsed.training_run_id.replace(":", "_")):
        raise ValueError(f"path {path!r}: names are letters, digits, '_', '.' and '-'")
    return root / parsed.training_run_id / "weights" / name


def saved_by(folder: Path) -> str | None:
    """The id of the request that wrote a checkpoint or sampler-weights folder (None: none recorded, or no folder)."""
    try:
        return json.loads((folder / CONFIG).read_text()).get("request_id")
    except FileNotFoundError:
        return None


def save(
    root: Path, model_id: str, name: str, state: State, overwrite: bool, run_id: str, request_id: str | None = None
) -> str:
    """Write checkpoint `name` of `model_id`; its tinker:// path. ValueError where it exists and not `overwrite`,
    unless request `request_id` wrote it (a request replayed after a crash that came after its folder was written:
    done already)."""
    path = tinker_path(model_id, name)
    final = folder_of(root, path)
    if request_id is not None and saved_by(final) == request_id:
        return path
    if final.exists() and not overwrite:
        raise ValueError(f"path {path!r} exists already (save with overwrite=True to replace it)")
    staging = final.with_name(f".tmp-{name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    scaling = state.lora.alpha / state.lora.rank
    save_file(state.adapters, str(staging / ADAPTER), metadata={"format": LORA_FORMAT, "lora_scaling": repr(scaling)})
    moments = {f"{index}.{key}": value for index, entry in state.optimizer.items() for key, value in entry.items()}
    save_file(moments, str(staging / OPTIMIZER), metadata={"num_parameters": str(state.num_parameters)})
    config = {"base_model": state.base_model, "lora": state.lora.model_dump(mode="json"), "request_id": request_id}
    (staging / CONFIG).write_text(json.dumps(config, indent=1))
    write_manifest(staging, run_id)
    fsync_tree(staging)
    replaced = final.with_name(f".old-{name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        replace_durably(final, replaced)
    replace_durably(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)
    return path


def load(root: Path, path: str) -> State:
    """ValueError naming the path where it holds no complete checkpoint, or one whose files fail their manifest."""
    folder = folder_of(root, path)
    if not folder.is_dir():
        raise ValueError(f"path {path!r}: no such checkpoint")
    if (problem := damage(folder)) is not None:
        raise ValueError(f"path {path!r}: {problem}")
    config = json.loads((folder / CONFIG).read_text())
    lora = LoraSpec.model_validate(config["lora"])
    adapters, _ = read_lora_version(folder / ADAPTER, lora.target_modules)
    optimizer: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / OPTIMIZER), framework="pt") as f:
        num_parameters = int((f.metadata() or {})["num_parameters"])
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            index, name = key.split(".", 1)
            optimizer.setdefault(int(index), {})[name] = f.get_tensor(key)
    return State(config["base_model"], lora, adapters, optimizer, num_parameters)
