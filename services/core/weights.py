"""Weight versions: published by the trainer as safetensors with a sha256, loaded by generators after checking it.

Version v is the policy after v optimizer steps; version 0 is the initial policy.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from reinforce.core.records_pb2 import WeightVersion

_CHUNK = 1 << 20


class WeightError(RuntimeError):
    """A weight file that is missing, corrupted or does not fit the model."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weight_path(weights_dir: Path, version: int) -> Path:
    return weights_dir / f"v{version:06d}.safetensors"


def publish(model: torch.nn.Module, weights_dir: Path, version: int, keep: int = 3) -> WeightVersion:
    """Write version `version` atomically (readers never see a partial file) and prune old versions."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weight_path(weights_dir, version)
    tmp = path.with_suffix(".tmp")
    # save_model (not save_file) because tied embeddings share storage, which save_file refuses.
    save_model(model, str(tmp), metadata={"version": str(version)})
    digest = sha256_of(tmp)
    os.replace(tmp, path)
    _prune(weights_dir, keep_from=version - keep + 1)
    return WeightVersion(
        version=version,
        uri=str(path.resolve()),
        sha256=digest,
        num_bytes=path.stat().st_size,
        published_at=time.time(),
    )


def _prune(weights_dir: Path, keep_from: int) -> None:
    for old in weights_dir.glob("v*.safetensors"):
        if int(old.stem[1:]) < keep_from:
            old.unlink(missing_ok=True)


def load_verified(model: torch.nn.Module, weights: WeightVersion) -> None:
    """Load a published version into `model` in place, refusing it unless its sha256 matches.

    The caller swaps between batches, so a refused file leaves the previous version serving.
    """
    path = Path(weights.uri)
    if not path.is_file():
        raise WeightError(f"weight version {weights.version}: file {path} does not exist")
    digest = sha256_of(path)
    if digest != weights.sha256:
        raise WeightError(f"weight version {weights.version}: sha256 of {path} is {digest}, expected {weights.sha256}")
    try:
        missing, unexpected = load_model(model, str(path), strict=True)
    except Exception as err:  # safetensors raises several types for a truncated or alien file
        raise WeightError(f"weight version {weights.version}: cannot load {path}: {err}") from err
    if missing or unexpected:
        raise WeightError(f"weight version {weights.version}: missing {missing}, unexpected {unexpected}")
