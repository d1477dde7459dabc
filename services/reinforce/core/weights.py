"""Weight versions: published by the trainer as safetensors with a sha256, loaded by generators after checking it.

Version v is the policy after v optimizer steps; version 0 is the initial policy.

A WeightVersion's uri is either a file path (trainer and generators share the run folder) or an http(s) URL
served by the trainer's WeightServer (trainer/weight_server.py; on Kubernetes they may share no volume):

    trainer:    server = WeightServer(weights_dir, token=t); server.start()
                publish(model, weights_dir, v, base_url=server.base_url(pod_ip))
    generator:  sources = WeightSources(run_weights_dir, trainer_url=server_base_url)
                load_verified(engine.load_weights, weights, sources, cache_dir=local_dir, token=t)

A generator loads only from its run's own weights folder or its run's trainer endpoint (WeightSources): the
token goes nowhere else, and no other file of the machine is ever read or hashed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx
import torch
from safetensors.torch import load_model

from reinforce.core.records_pb2 import WeightVersion

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
# A published version's chunks (WeightVersion.chunk_sha256): at least 1 MiB, and at most MAX_CHUNKS of them, so the
# record every generator reads from Redis stays a few kB however large the model (16 GB: 512 chunks of 32 MiB).
MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 512
WEIGHTS_ROUTE = "/v1/weights/"  # the weight endpoint's path (core/weight_http.py), a published file's name after it
FILE_NAME = re.compile(r"v[0-9]{6,12}\.safetensors")  # the names weight_path writes: the only ones ever served

# A fetch is retried on connection errors, truncated bodies and 5xx (a trainer pod restarting), not on 4xx.
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
_HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class WeightError(RuntimeError):
    """A weight file that is missing, corrupted or does not fit the model."""


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What one load cost (exported by the generator as metrics).

    num_bytes: bytes read (file) or transferred (http). fetch_seconds: reading and hashing the file, or
    downloading and hashing it in the same pass. load_seconds: copying the verified file into the model.
    """

    num_bytes: int
    fetch_seconds: float
    load_seconds: float


@dataclass(frozen=True, slots=True)
class WeightSources:
    """Where a run's weight versions may come from: its weights folder and its trainer's endpoint, if any.

    Version v's uri must be exactly `weights_dir/vNNNNNN.safetensors` or `{trainer_url}/v1/weights/vNNNNNN.safetensors`.
    """

    weights_dir: Path
    trainer_url: str | None = None

    def check(self, weights: WeightVersion) -> None:
        """Refuse a uri naming anything else (another host, another file), without touching it."""
        name = weight_path(Path(), weights.version).name
        allowed = [str(self.weights_dir.resolve() / name)]
        if self.trainer_url:
            allowed.append(f"{self.trainer_url.rstrip('/')}{WEIGHTS_ROUTE}{name}")
        if weights.uri not in allowed:
            raise WeightError(
                f"weight version {weights.version}: uri {weights.uri!r} is not this run's (expected one of {allowed})"
            )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def weight_path(weights_dir: Path, version: int) -> Path:
    return weights_dir / f"v{version:06d}.safetensors"


def chunk_bytes_for(num_bytes: int) -> int:
    """The chunk size of a file of `num_bytes`: a power of two from MIN_CHUNK_BYTES, at most MAX_CHUNKS chunks."""
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < num_bytes:
        size *= 2
    return size


class ChunkDigests:
    """The sha256 of each `chunk_bytes` piece of a stream fed to `update` in pieces of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.digests: list[bytes] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.chunk_bytes - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._close_chunk()

    def finish(self) -> list[bytes]:
        if self._filled:
            self._close_chunk()
        return self.digests

    def _close_chunk(self) -> None:
        self.digests.append(self._current.digest())
        self._current, self._filled = hashlib.sha256(), 0


def publish(
    model: torch.nn.Module | dict[str, torch.Tensor],
    weights_dir: Path,
    version: int,
    keep: int = 3,
    base_url: str | None = None,
    metadata: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> WeightVersion:
    """Write version `version` atomically (readers never see a partial file) and prune old versions.

    `dtype` casts every floating-point tensor: the generators' precision, so a bfloat16 engine's weights travel,
    hash and load in half the bytes. Casting here or in the engine rounds the same way (to nearest even), so what
    the generators serve does not change. The uri is the file's absolute path, or `{base_url}/v1/weights/{file}`
    when the trainer serves the folder with a WeightServer (see WeightServer.base_url).
    """
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weight_path(weights_dir, version)
    tmp = path.with_suffix(".tmp")
    tensors = distinct_tensors(model) if isinstance(model, torch.nn.Module) else model
    if dtype is not None:
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    chunks = ChunkDigests(chunk_bytes_for(sum(t.numel() * t.element_size() for t in tensors.values())))
    try:
        num_bytes, digest = write_safetensors(tmp, tensors, {"version": str(version), **(metadata or {})}, chunks)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep a partial version beside the others
        raise
    _prune(weights_dir, keep_from=version - keep + 1)
    uri = f"{base_url.rstrip('/')}{WEIGHTS_ROUTE}{path.name}" if base_url else str(path.resolve())
    return WeightVersion(
        version=version,
        uri=uri,
        sha256=digest,
        num_bytes=num_bytes,
        published_at=time.time(),
        chunk_bytes=chunks.chunk_bytes,
        chunk_sha256=chunks.finish(),
    )


# safetensors' names of the dtypes a policy's state dict holds
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], chunks: ChunkDigests | None = None
) -> tuple[int, str]:
    """Write `tensors` to `path` in the safetensors format and return (bytes, sha256 of them); `chunks`, when
    given, also hashes each of its chunks.

    The file is hashed as it is written, straight from the tensors' memory: no serialised copy, no reading back.
    Format: an 8-byte little-endian header length, the JSON header (names, dtypes, shapes, byte offsets, metadata)
    padded with spaces to a multiple of 8, then each tensor's bytes in header order.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be written as safetensors here")
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    num_bytes = 0
    # Two passes of sha256 over the same bytes (the whole file's, each chunk's), each on a thread of its own beside
    # the writing (hashlib and file writes release the GIL), so the write waits for neither. One worker per pass
    # keeps its pieces in order.
    hashers = [(digest.update, ThreadPoolExecutor(max_workers=1))]
    if chunks is not None:
        hashers.append((chunks.update, ThreadPoolExecutor(max_workers=1)))
    pending = []
    try:
        with path.open("wb") as f:
            for piece in (len(encoded).to_bytes(8, "little"), encoded, *map(_raw_bytes, tensors.values())):
                pending += [pool.submit(update, piece) for update, pool in hashers]
                f.write(piece)
                num_bytes += len(piece)
        for hashed in pending:
            hashed.result()
    finally:
        for _, pool in hashers:
            pool.shutdown(cancel_futures=True)
    return num_bytes, digest.hexdigest()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order (safetensors is little-endian, as every CPU torch runs on here)."""
    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def distinct_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with tensors that alias one another (tied embeddings) once, under the first of their
    names in sorted order: the names safetensors' save_model keeps (lm_head.weight for a tied embedding)."""
    state = model.state_dict()
    first_name: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name in sorted(state):
        tensor = state[name]
        first_name.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)), name)
    return {name: state[name] for name in first_name.values()}


def _prune(weights_dir: Path, keep_from: int) -> None:
    for old in weights_dir.glob("v*.safetensors"):
        if int(old.stem[1:]) < keep_from:
            old.unlink(missing_ok=True)


# ---- loading ------------------------------------------------------------------------------------------------


def load_verified(
    load: Callable[[Path], None],
    weights: WeightVersion,
    sources: WeightSources,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> LoadStats:
    """Call `load(path)` on a published version's file, refusing it unless its sha256 matches.

    The uri must name one of the run's `sources` (checked first: nothing else is opened or contacted). `load`
    loads a safetensors file of the policy in place (an engine's `load_weights`, or `module_loader(model)`).
    An http(s) uri is streamed into a temporary file in `cache_dir` (required then) while it is hashed, checked,
    loaded and deleted; `token` is sent as a bearer token. The caller swaps between batches, so a refused file
    leaves the previous version serving: `load` is called only after the digest matched.
    """
    sources.check(weights)
    if weights.uri.startswith(("http://", "https://")):
        return _load_http(load, weights, cache_dir, token)
    return _load_file(load, weights)


def module_loader(model: torch.nn.Module) -> Callable[[Path], None]:
    """A `load` for load_verified: the file's tensors into `model` in place, every name and shape as the model's."""

    def load(path: Path) -> None:
        missing, unexpected = load_model(model, str(path), strict=True)
        if missing or unexpected:
            raise WeightError(f"missing {missing}, unexpected {unexpected}")

    return load


def _load_file(load: Callable[[Path], None], weights: WeightVersion) -> LoadStats:
    path = Path(weights.uri)
    if path.is_symlink() or not path.is_file():  # a link planted in the folder must not lead elsewhere
        raise WeightError(f"weight version {weights.version}: file {path} does not exist")
    start = time.perf_counter()
    digest = sha256_of(path)
    fetched = time.perf_counter()
    check_digest(weights, str(path), digest)
    load_into(load, weights, path)
    return LoadStats(path.stat().st_size, fetched - start, time.perf_counter() - fetched)


def _load_http(
    load: Callable[[Path], None], weights: WeightVersion, cache_dir: Path | None, token: str | None
) -> LoadStats:
    if cache_dir is None:
        raise ValueError(f"weight version {weights.version}: an http uri needs a cache_dir to download into")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"v{weights.version:06d}-", suffix=".part", dir=cache_dir)
    tmp = Path(name)
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb") as out:
            num_bytes, digest = _download(weights, token, out)
        fetched = time.perf_counter()
        check_digest(weights, weights.uri, digest)
        load_into(load, weights, tmp)
        return LoadStats(num_bytes, fetched - start, time.perf_counter() - fetched)
    finally:
        tmp.unlink(missing_ok=True)


def check_digest(weights: WeightVersion, source: str, digest: str) -> None:
    if digest != weights.sha256:
        # The digest itself is not echoed: an error message must not become a way to hash files.
        raise WeightError(f"weight version {weights.version}: sha256 of {source} does not match the published one")


def load_into(load: Callable[[Path], None], weights: WeightVersion, path: Path) -> None:
    try:
        load(path)
    except Exception as err:  # safetensors raises several types for a truncated or alien file
        raise WeightError(f"weight version {weights.version}: cannot load {weights.uri}: {err}") from err


class Transient(Exception):
    """A failed fetch worth retrying: the connection broke, the body was cut short, or the server said 5xx."""


def _download(weights: WeightVersion, token: str | None, out: BinaryIO) -> tuple[int, str]:
    """Stream weights.uri into `out`, hashing as it goes; (bytes, sha256 hex). Retries with back-off."""
    with httpx.Client(timeout=_HTTP_TIMEOUT, headers=download_headers(token)) as client:
        for attempt, delay in enumerate((*RETRY_BACKOFF_S, None), start=1):
            try:
                return _download_once(client, weights, out)
            except Transient as err:
                if delay is None:
                    raise WeightError(
                        f"weight version {weights.version}: cannot fetch {weights.uri} after {attempt} attempts: {err}"
                    ) from err
                log.warning("weight version %d: fetch attempt %d failed (%s); retrying", weights.version, attempt, err)
                time.sleep(delay)
    raise AssertionError("unreachable")


def download_headers(token: str | None) -> dict[str, str]:
    # identity: the sha256 and Content-Length are of the file's bytes, so no proxy may compress them
    headers = {"Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _download_once(client: httpx.Client, weights: WeightVersion, out: BinaryIO) -> tuple[int, str]:
    out.seek(0)
    out.truncate()  # a retry starts over: no Range requests, the whole file is hashed in one pass
    digest = hashlib.sha256()
    num_bytes = 0
    try:
        with client.stream("GET", weights.uri) as response:
            check_status(weights, response)
            for chunk in response.iter_raw():
                num_bytes += len(chunk)
                _check_not_too_long(weights, num_bytes)
                digest.update(chunk)
                out.write(chunk)
            expected = response.headers.get("content-length")
    except httpx.TransportError as err:
        raise Transient(f"{type(err).__name__}: {err}") from err
    if expected is not None and num_bytes != int(expected):
        raise Transient(f"body cut short: {num_bytes} of {expected} bytes")
    return num_bytes, digest.hexdigest()


def check_status(weights: WeightVersion, response: httpx.Response) -> None:
    code = response.status_code
    if code == 200:
        return
    if code >= 500:
        raise Transient(f"HTTP {code}")
    if code == 404:
        reason = "not found (pruned, or never published here)"
    elif code in (401, 403):
        reason = "unauthorized (missing or wrong weight token)"
    else:
        reason = "unexpected answer"
    raise WeightError(f"weight version {weights.version}: {weights.uri}: HTTP {code}, {reason}")


def _check_not_too_long(weights: WeightVersion, num_bytes: int) -> None:
    # Stop a wrong or hostile server early rather than filling the generator's disk before the sha256 check.
    if weights.num_bytes and num_bytes > weights.num_bytes:
        raise WeightError(
            f"weight version {weights.version}: {weights.uri} sent more than the published {weights.num_bytes} bytes"
        )
