"""Relayed weight distribution (`weights.distribution: relay`): the trainer sends a version once, generators pass it on.

The weight reconciler plans a tree of fan-out `weights.relay_fanout` over the generators it sees (1: a chain;
core/rollout.py's plan_relay) and tells each generator, in its load request, the relay addresses of its ancestors,
nearest first (core/generator_api.py's load_request_json: a WeightVersion plus "relaySources"; a plain WeightVersion
still means a direct fetch).
A generator's Relay fetches the version from the nearest ancestor, checks each chunk against the published record's
chunk_sha256 and only then appends it to the file that its own relay endpoint serves to its successors, while the rest
is still arriving. A source that fails, refuses, sends a wrong chunk or nothing for `stall_s` is left for the next
one, resuming at the first unverified byte (Range): its successors fall back to their predecessor's source, and the
trainer's uri is the last. The ancestors have `deadline_s` for the whole version (a source trickling a byte at a time
never stalls): past it the rest comes from the trainer's uri. The whole file's sha256 is checked before the file is
loaded, as with a direct fetch: nothing unverified is forwarded or loaded.

    generator:  relay = Relay(cache_dir, token, host, stall_s, deadline_s)
                relay.start()                           # GET /v1/weights/vNNNNNN.safetensors
                relay.request(published, ancestors)     # on a load request: the fetch starts in a thread
                stats = relay.load(engine.load_weights, weights, sources)    # between batches: waits, loads

The relay endpoint checks the run's weights token (REINFORCE_WEIGHTS_TOKEN), as the trainer's does, and the token
goes only to the relays the reconciler planned for the version (its RelayPlan in Redis, which the generator checks a
load request's sources against: the control token alone vouches for none).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from reinforce.core import weights as weight_files
from reinforce.core.names import LOCAL_HOST
from reinforce.core.records_pb2 import WeightVersion
from reinforce.core.weight_http import WeightHandler, WeightHTTPServer
from reinforce.core.weights import (
    WEIGHTS_ROUTE,
    LoadStats,
    Transient,
    WeightError,
    WeightSources,
    check_digest,
    check_status,
    download_headers,
    load_into,
    weight_path,
)

log = logging.getLogger(__name__)

# How long a relay answers a request for a version it has not begun: its own load request may arrive a moment
# after its successor's.
BEGIN_WAIT_S = 5.0


def _same_record(a: WeightVersion, b: WeightVersion) -> bool:
    return (a.version, a.uri, a.sha256) == (b.version, b.uri, b.sha256)


@dataclass
class _Transfer:
    """One version on its way through this relay: `path` holds its first `verified` bytes, each chunk checked."""

    weights: WeightVersion
    path: Path
    verified: int = 0
    done: bool = False  # every byte arrived and the whole file's sha256 matched
    failed: str = ""  # why it ended without: every source failed, or a newer version replaced it
    fetch_seconds: float = 0.0

    @property
    def ended(self) -> bool:
        return self.done or bool(self.failed)


class Relay:
    """A generator's side of relayed distribution: fetches requested versions and serves them on, as they arrive."""

    def __init__(
        self,
        cache_dir: Path,
        token: str,
        host: str = LOCAL_HOST,
        stall_s: float = 10.0,
        deadline_s: float = 120.0,
        port: int = 0,
    ) -> None:
        self.cache_dir = cache_dir
        self.token = token
        self.stall_s = stall_s
        self.deadline_s = deadline_s
        self._cond = threading.Condition()
        self._transfer: _Transfer | None = None
        self._count = 0  # transfers begun: their files' names
        self._server = WeightHTTPServer((host, port), RelayHandler, cache_dir, token)
        self._server.relay = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> int:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._thread = self._server.serve_in_thread("relay")
        return self.port

    def stop(self) -> None:
        with self._cond:
            if self._transfer is not None and not self._transfer.ended:
                self._transfer.failed = "the relay stopped"
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # ---- receiving --------------------------------------------------------------------------------------------
    def request(self, published: WeightVersion, ancestors: list[str]) -> None:
        """Start fetching `published` (the record from Redis, chunk digests included) from `ancestors` then its uri,
        unless this relay holds or is fetching it already. A newer request replaces an unfinished transfer."""
        if not published.chunk_sha256:
            raise WeightError(f"weight version {published.version}: published without chunk digests, cannot relay")
        with self._cond:
            current = self._transfer
            if current is not None and _same_record(current.weights, published) and not current.failed:
                return
            if current is not None:
                current.failed = current.failed or "replaced by another version"
                current.path.unlink(missing_ok=True)  # readers that opened it keep their descriptor
            self._count += 1
            name = f"relay-{self._count}-{weight_path(Path(), published.version).name}"
            transfer = _Transfer(published, self.cache_dir / name)
            self._transfer = transfer
            self._cond.notify_all()
        args = (transfer, ancestors)
        threading.Thread(target=self._fetch, args=args, name=f"relay-v{published.version}", daemon=True).start()

    def requested(self, weights: WeightVersion) -> bool:
        with self._cond:
            return self._transfer is not None and _same_record(self._transfer.weights, weights)

    def held_version(self) -> int | None:
        """The version this relay can serve whole, if any (the reconciler puts such relays at the top)."""
        with self._cond:
            return self._transfer.weights.version if self._transfer is not None and self._transfer.done else None

    def load(self, load: Callable[[Path], None], weights: WeightVersion, sources: WeightSources) -> LoadStats:
        """Wait for the requested `weights` to arrive whole and verified, then `load` it (WeightError otherwise)."""
        sources.check(weights)
        with self._cond:
            transfer = self._transfer
            if transfer is None or not _same_record(transfer.weights, weights):
                raise WeightError(f"weight version {weights.version}: never requested from the relay")
            self._cond.wait_for(lambda: transfer.ended)
        if not transfer.done:
            raise WeightError(f"weight version {weights.version}: relayed fetch failed: {transfer.failed}")
        start = time.perf_counter()
        load_into(load, weights, transfer.path)
        return LoadStats(transfer.weights.num_bytes, transfer.fetch_seconds, time.perf_counter() - start)

    def _fetch(self, transfer: _Transfer, ancestors: list[str]) -> None:
        weights = transfer.weights
        start = time.perf_counter()
        whole = hashlib.sha256()
        try:
            timeout = httpx.Timeout(self.stall_s, connect=min(self.stall_s, 10.0))
            with (
                transfer.path.open("wb", buffering=0) as out,
                httpx.Client(timeout=timeout, headers=download_headers(self.token)) as client,
            ):
                used = []  # the sources bytes came from, with how many (the log says how a version travelled)
                deadline = time.monotonic() + self.deadline_s
                for url, until in self._sources(transfer, ancestors, deadline):
                    before = transfer.verified
                    try:
                        self._pull(client, url, transfer, out, whole, until)
                        break
                    except (Transient, WeightError) as err:
                        log.warning("weight version %d: %s failed at byte %d (%s)", weights.version, url,
                                    transfer.verified, err)  # fmt: skip
                    finally:
                        used += [f"{transfer.verified - before} bytes from {url}"] if transfer.verified > before else []
            if transfer.failed:
                return
            if transfer.verified != weights.num_bytes:
                raise WeightError(f"weight version {weights.version}: no source sent it whole (the trainer's last)")
            check_digest(weights, weights.uri, whole.hexdigest())
            seconds = time.perf_counter() - start
            # logged before the loader is woken, so that whoever loads it finds the line already written
            log.info("weight version %d relayed in %.2fs: %s", weights.version, seconds, ", ".join(used))
            self._end(transfer, done=True, seconds=seconds)
        except (WeightError, OSError) as err:
            log.error("relay: %s", err)
            self._end(transfer, failed=str(err))

    def _sources(self, transfer: _Transfer, ancestors: list[str], deadline: float) -> Iterator[tuple[str, float]]:
        """(url, until when it may send) of the ancestors' relays nearest first, while `deadline` has not passed, then
        of the trainer's uri, without a deadline and retried with back-off (a pod restarting)."""
        name = weight_path(Path(), transfer.weights.version).name
        for base in ancestors:
            if time.monotonic() >= deadline:
                break
            yield f"{base}{WEIGHTS_ROUTE}{name}", deadline
        for delay in (0.0, *weight_files.RETRY_BACKOFF_S):
            time.sleep(delay)
            if transfer.failed:
                return
            yield transfer.weights.uri, math.inf

    def _pull(
        self, client: httpx.Client, url: str, transfer: _Transfer, out: BinaryIO, whole: hashlib._Hash, until: float
    ) -> None:
        """Append what `url` sends from the first unverified byte on, a whole matching chunk at a time, until the
        version is whole or the time `until` (Transient then)."""
        weights = transfer.weights
        offset = transfer.verified
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        pending = bytearray()  # the chunk being received, until it is whole and matches
        try:
            with client.stream("GET", url, headers=headers) as response:
                if response.status_code not in (200, 206):
                    check_status(weights, response)
                if offset and response.status_code != 206:
                    raise Transient(f"HTTP {response.status_code} to a Range request")
                for data in response.iter_raw():
                    if transfer.failed:
                        return
                    if time.monotonic() > until:
                        raise Transient(f"the relays' deadline passed ({self.deadline_s:g} s for the whole version)")
                    pending += data
                    self._append_verified(transfer, pending, out, whole)
                    if transfer.verified == weights.num_bytes:  # whatever else it would send is not read
                        return
        except httpx.TransportError as err:
            raise Transient(f"{type(err).__name__}: {err}") from err
        if transfer.verified < weights.num_bytes and not transfer.failed:
            raise Transient(f"body cut short at byte {transfer.verified + len(pending)} of {weights.num_bytes}")

    def _append_verified(self, transfer: _Transfer, pending: bytearray, out: BinaryIO, whole: hashlib._Hash) -> None:
        weights = transfer.weights
        while pending and transfer.verified < weights.num_bytes:
            index = transfer.verified // weights.chunk_bytes
            size = min(weights.chunk_bytes, weights.num_bytes - transfer.verified)
            if len(pending) < size:
                return
            chunk = memoryview(pending)[:size]
            if hashlib.sha256(chunk).digest() != weights.chunk_sha256[index]:
                chunk.release()
                pending.clear()
                raise WeightError(f"weight version {weights.version}: chunk {index} does not match its digest")
            out.write(chunk)
            whole.update(chunk)
            chunk.release()
            del pending[:size]
            with self._cond:
                transfer.verified += size
                self._cond.notify_all()

    def _end(self, transfer: _Transfer, done: bool = False, failed: str = "", seconds: float = 0.0) -> None:
        with self._cond:
            if not transfer.failed:
                transfer.done, transfer.failed, transfer.fetch_seconds = done, failed, seconds
            self._cond.notify_all()

    # ---- serving ----------------------------------------------------------------------------------------------
    def begun(self, version: int) -> _Transfer | None:
        """The live transfer of `version`, waiting BEGIN_WAIT_S for it to begin; None if it does not."""
        with self._cond:
            self._cond.wait_for(lambda: self._serves(version), timeout=BEGIN_WAIT_S)
            return self._transfer if self._serves(version) else None

    def _serves(self, version: int) -> bool:
        t = self._transfer
        return t is not None and t.weights.version == version and not t.failed

    def verified_past(self, transfer: _Transfer, position: int) -> int | None:
        """Bytes verified once more than `position` are, or None when the transfer ended short of that."""
        with self._cond:
            self._cond.wait_for(lambda: transfer.verified > position or bool(transfer.failed))
            return transfer.verified if transfer.verified > position else None


class RelayHandler(WeightHandler):
    """GET /v1/weights/vNNNNNN.safetensors on a generator: its live transfer, verified bytes only, as they arrive."""

    def send_named(self, name: str, offset: int, send_body: bool) -> None:
        relay: Relay = self.server.relay  # type: ignore[attr-defined]
        transfer = relay.begun(int(name[1:].partition(".")[0]))
        if transfer is None:
            self.send_error(404)
            return
        try:
            f = transfer.path.open("rb")
        except OSError:  # replaced between the two lines: as if it had never begun
            self.send_error(404)
            return
        with f:
            size = transfer.weights.num_bytes
            if not self.send_head(size, offset) or not send_body:
                return
            self._stream(relay, transfer, f, offset, size)

    def _stream(self, relay: Relay, transfer: _Transfer, f: BinaryIO, position: int, size: int) -> None:
        try:
            while position < size:
                available = relay.verified_past(transfer, position)
                if available is None:  # the transfer failed: cut the body short, the successor falls back
                    break
                self.connection.sendfile(f, position, available - position)
                position = available
        except OSError as err:  # the successor went away
            log.debug("relay of %s ended early: %s", self.path, err)
        self.close_connection = position < size
