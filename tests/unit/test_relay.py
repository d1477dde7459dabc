"""Relayed weight distribution (generator/relay.py): real HTTP between a trainer's WeightServer and generators' Relays.

Faults are injected by small HTTP servers that pause, die or lie; everything else is the production code.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from google.protobuf.json_format import ParseError
from safetensors.torch import load_file

from reinforce.core import weights as weights_module
from reinforce.core.generator_api import load_request_json, parse_load_request
from reinforce.core.records_pb2 import WeightVersion
from reinforce.core.rollout import plan_relay
from reinforce.core.weights import (
    MAX_CHUNKS,
    MIN_CHUNK_BYTES,
    WeightError,
    WeightSources,
    chunk_bytes_for,
    publish,
)
from reinforce.generator.relay import Relay
from reinforce.trainer.weight_server import WeightServer

TOKEN = "weights-token"
NAME = "v000001.safetensors"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_module, "RETRY_BACKOFF_S", (0.01,))


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[WeightServer]:
    with WeightServer(tmp_path / "trainer", host="127.0.0.1", token=TOKEN) as server:
        yield server


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[list[Relay]]:
    """Four generators' relays, each with its own folder (nothing shared), patient with a source that stalls."""
    started = [Relay(tmp_path / f"gen-{i}", TOKEN, "127.0.0.1", stall_s=30.0) for i in range(4)]
    for relay in started:
        relay.start()
    yield started
    for relay in started:
        relay.stop()


def published_on(trainer: WeightServer, megabytes: int = 3) -> tuple[WeightVersion, dict[str, torch.Tensor]]:
    """Version 1 of a float32 'policy' of `megabytes` MiB: several chunks."""
    tensors = {"w": torch.randn(megabytes * (1 << 18), generator=torch.Generator().manual_seed(0))}
    return publish(tensors, trainer.weights_dir, 1, base_url=trainer.base_url("127.0.0.1")), tensors


def url(relay: Relay) -> str:
    return f"http://127.0.0.1:{relay.port}"


def loaded(relay: Relay, weights: WeightVersion, trainer: WeightServer) -> dict[str, torch.Tensor]:
    """What a generator loads from its relay (safetensors into a dict, as an engine's load_weights reads it)."""
    out: dict[str, torch.Tensor] = {}
    relay.load(
        lambda path: out.update(load_file(path)),
        weights,
        WeightSources(trainer.weights_dir, trainer.base_url("127.0.0.1")),
    )
    return out


def test_publish_records_each_chunk_digest(trainer: WeightServer):
    weights, _ = published_on(trainer)
    data = (trainer.weights_dir / NAME).read_bytes()
    size = weights.chunk_bytes
    assert size == MIN_CHUNK_BYTES and len(weights.chunk_sha256) == 4  # 3 MiB of tensor plus the header
    assert list(weights.chunk_sha256) == [
        hashlib.sha256(data[i : i + size]).digest() for i in range(0, len(data), size)
    ]
    assert chunk_bytes_for(16 << 30) == 32 << 20 and (16 << 30) // chunk_bytes_for(16 << 30) == MAX_CHUNKS


def test_plan_is_a_chain_or_a_tree_with_holders_on_top():
    relays = {name: f"http://{name}:1" for name in ("g0", "g1", "g2", "g3", "g4")}
    chain = plan_relay(relays, fanout=1)
    assert chain["g0"] == [] and chain["g3"] == ["http://g2:1", "http://g1:1", "http://g0:1"]
    tree = plan_relay(relays, fanout=2)
    assert tree["g1"] == tree["g2"] == ["http://g0:1"] and tree["g4"] == ["http://g1:1", "http://g0:1"]
    held = plan_relay(relays, fanout=1, first=["g3"])
    assert held["g3"] == [] and held["g0"] == ["http://g3:1"]


def test_the_load_request_is_a_weight_version_plus_relay_sources(trainer: WeightServer):
    weights, _ = published_on(trainer)
    body = load_request_json(weights, ["http://10.0.0.2:4000"])
    assert "chunkSha256" not in body and body["relaySources"] == ["http://10.0.0.2:4000"]
    parsed, sources = parse_load_request(body)
    assert (parsed.version, parsed.sha256, sources) == (1, weights.sha256, ["http://10.0.0.2:4000"])
    assert parse_load_request(load_request_json(weights))[1] is None  # a plain WeightVersion: a direct fetch
    for bad in (["http://h:1/x"], ["file:///etc/passwd"], "http://h:1", [3]):
        with pytest.raises(ValueError, match="relaySources"):
            parse_load_request({**body, "relaySources": bad})
    with pytest.raises(ParseError):
        parse_load_request({**body, "bogus": 1})


def test_the_trainer_endpoint_serves_a_tail_and_refuses_other_ranges(trainer: WeightServer):
    weights, _ = published_on(trainer)
    data = (trainer.weights_dir / NAME).read_bytes()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tail = httpx.get(weights.uri, headers={**auth, "Range": "bytes=1000-"})
    assert tail.status_code == 206 and tail.content == data[1000:]
    assert tail.headers["content-range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    assert httpx.get(weights.uri, headers={**auth, "Range": "bytes=0-10"}).status_code == 416
    assert httpx.get(weights.uri, headers={**auth, "Range": f"bytes={len(data)}-"}).status_code == 416


def test_a_chain_loads_the_version_everywhere(trainer: WeightServer, relays: list[Relay]):
    weights, tensors = published_on(trainer)
    plan = plan_relay({str(i): url(r) for i, r in enumerate(relays)}, fanout=1)
    for i, relay in enumerate(relays):
        relay.request(weights, plan[str(i)])
    for relay in relays:
        assert torch.equal(loaded(relay, weights, trainer)["w"], tensors["w"])
        assert relay.held_version() == 1


class _Gate(BaseHTTPRequestHandler):
    """A trainer endpoint under test control: sends the first `first_bytes` of `payload`, then waits for `gate`
    before the rest (or, with `die`, closes the connection instead). Later requests are served at once (Range too)."""

    protocol_version = "HTTP/1.1"
    payload = b""
    first_bytes = 0
    gate: threading.Event
    die = False
    requests: list[str]

    def do_GET(self) -> None:
        offset = int(self.headers.get("Range", "bytes=0-")[6:-1])
        self.requests.append(self.headers.get("Range", ""))
        self.send_response(206 if offset else 200)
        self.send_header("Content-Length", str(len(self.payload) - offset))
        self.end_headers()
        if len(self.requests) > 1:
            self.wfile.write(self.payload[offset:])
            return
        self.wfile.write(self.payload[: self.first_bytes])
        self.wfile.flush()
        self.gate.wait(20)
        if not self.die:
            self.wfile.write(self.payload[self.first_bytes :])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gated(trainer: WeightServer) -> Iterator[tuple[WeightVersion, dict[str, torch.Tensor], type[_Gate]]]:
    """Version 1 behind a _Gate that holds back all but its first 2 MiB until the test opens the gate."""
    weights, tensors = published_on(trainer)
    handler = type("Gate", (_Gate,), {
        "payload": (trainer.weights_dir / NAME).read_bytes(), "first_bytes": 2 << 20, "gate": threading.Event(),
        "requests": [],
    })  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gate_url = f"http://127.0.0.1:{server.server_address[1]}/v1/weights/{NAME}"
    relayed = WeightVersion()
    relayed.CopyFrom(weights)
    relayed.uri = gate_url
    yield relayed, tensors, handler
    handler.gate.set()
    server.shutdown()
    server.server_close()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def verified(relay: Relay) -> int:
    return relay._transfer.verified if relay._transfer else 0


def test_a_relay_forwards_chunks_while_it_receives_them(gated, relays: list[Relay], tmp_path: Path):
    weights, tensors, handler = gated
    first, second = relays[0], relays[1]
    first.request(weights, [])
    second.request(weights, [url(first)])
    # the trainer has sent 2 of 4 chunks: the successor already holds both, before its relay has the rest
    wait_for(lambda: verified(second) == 2 << 20)
    assert verified(first) == 2 << 20 and len(handler.requests) == 1
    handler.gate.set()
    allowed = WeightSources(tmp_path, weights.uri.rpartition("/v1/")[0])
    for relay in (first, second):
        out: dict[str, torch.Tensor] = {}
        relay.load(lambda p: out.update(load_file(p)), weights, allowed)  # noqa: B023
        assert torch.equal(out["w"], tensors["w"])
    assert len(handler.requests) == 1  # the trainer sent the version once


def test_a_dead_relay_is_routed_around_resuming_where_it_stopped(gated, relays: list[Relay], tmp_path: Path):
    weights, tensors, handler = gated
    first, second, third = relays[:3]
    first.request(weights, [])
    second.request(weights, [url(first)])
    third.request(weights, [url(second), url(first)])
    wait_for(lambda: verified(third) == 2 << 20)
    first.stop()  # the first relay dies mid-transfer: its successor falls back to its source, the trainer
    allowed = WeightSources(tmp_path, weights.uri.rpartition("/v1/")[0])
    for relay in (second, third):
        out: dict[str, torch.Tensor] = {}
        relay.load(lambda p: out.update(load_file(p)), weights, allowed)  # noqa: B023
        assert torch.equal(out["w"], tensors["w"])
    # the second relay asked the trainer for the rest only, never for the 2 MiB it had verified
    assert handler.requests == ["", f"bytes={2 << 20}-"]


def test_a_stalled_relay_is_left_after_stall_s(gated, relays: list[Relay], tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, logger="reinforce.generator.relay")
    weights, tensors, handler = gated
    first = relays[0]  # waits on its source (the trainer holding back the rest) far longer than its successor will
    first.request(weights, [])
    wait_for(lambda: verified(first) == 2 << 20)
    impatient = Relay(tmp_path / "impatient", TOKEN, "127.0.0.1", stall_s=1.0)
    impatient.start()
    try:
        start = time.monotonic()
        impatient.request(weights, [url(first)])
        out: dict[str, torch.Tensor] = {}
        allowed = WeightSources(tmp_path, weights.uri.rpartition("/v1/")[0])
        impatient.load(lambda p: out.update(load_file(p)), weights, allowed)
        assert torch.equal(out["w"], tensors["w"]) and 1.0 <= time.monotonic() - start < 5.0
    finally:
        impatient.stop()
    assert not first._transfer.ended  # still waiting
    # the successor took the 2 MiB the stalled relay had, then asked the trainer for the rest only
    assert handler.requests == ["", f"bytes={2 << 20}-"]
    assert f"{2 << 20} bytes from {url(first)}/v1/weights/{NAME}, " in caplog.text


class _Liar(BaseHTTPRequestHandler):
    """A relay that sends the right length with one byte flipped in the second chunk."""

    protocol_version = "HTTP/1.1"
    payload = b""

    def do_GET(self) -> None:
        data = bytearray(self.payload)
        data[MIN_CHUNK_BYTES + 5] ^= 0xFF
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(bytes(data))

    def log_message(self, *args: object) -> None:
        pass


def test_a_corrupted_chunk_is_neither_forwarded_nor_loaded(trainer: WeightServer, relays: list[Relay]):
    weights, tensors = published_on(trainer)
    liar = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Liar", (_Liar,), {"payload": (trainer.weights_dir / NAME).read_bytes()})
    )
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    try:
        relays[0].request(weights, [f"http://127.0.0.1:{liar.server_address[1]}"])
        assert torch.equal(loaded(relays[0], weights, trainer)["w"], tensors["w"])  # the rest came from the trainer
    finally:
        liar.shutdown()
        liar.server_close()
    forged = WeightVersion()
    forged.CopyFrom(weights)
    forged.sha256 = "0" * 64  # chunks match, the whole file does not: refused, never loaded
    relays[1].request(forged, [url(relays[0])])
    with pytest.raises(WeightError, match=r"sha256 of .* does not match"):
        relays[1].load(
            lambda p: pytest.fail("loaded an unverified file"),
            forged,
            WeightSources(trainer.weights_dir, trainer.base_url("127.0.0.1")),
        )


class _Trickle(BaseHTTPRequestHandler):
    """A relay that sends the right bytes, one every 0.2 s: never silent for a stall, never done."""

    protocol_version = "HTTP/1.1"
    payload = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        for i in range(len(self.payload)):
            self.wfile.write(self.payload[i : i + 1])
            self.wfile.flush()
            time.sleep(0.2)

    def log_message(self, *args: object) -> None:
        pass


def test_a_source_trickling_bytes_is_left_at_the_relays_deadline(trainer: WeightServer, tmp_path: Path):
    """The red team's R4-6: a source sending a byte every 5 s held a version for as long as it liked (the stall
    never fires). The ancestors have deadline_s for the whole version; then the trainer sends the rest."""
    weights, tensors = published_on(trainer)
    trickle = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Trickle", (_Trickle,), {"payload": (trainer.weights_dir / NAME).read_bytes()})
    )
    trickle.daemon_threads = True
    threading.Thread(target=trickle.serve_forever, daemon=True).start()
    relay = Relay(tmp_path / "relay", TOKEN, "127.0.0.1", stall_s=1.0, deadline_s=2.0)
    relay.start()
    try:
        start = time.monotonic()
        relay.request(weights, [f"http://127.0.0.1:{trickle.server_address[1]}"])
        assert torch.equal(loaded(relay, weights, trainer)["w"], tensors["w"])
        assert 2.0 <= time.monotonic() - start < 8.0
    finally:
        relay.stop()
        trickle.shutdown()
        trickle.server_close()


def test_the_relay_endpoint_needs_the_weights_token(trainer: WeightServer, relays: list[Relay]):
    weights, _ = published_on(trainer)
    relays[0].request(weights, [])
    loaded(relays[0], weights, trainer)
    target = f"{url(relays[0])}/v1/weights/{NAME}"
    assert httpx.get(target).status_code == 401
    assert httpx.get(target, headers={"Authorization": "Bearer wrong"}).status_code == 401
    reply = httpx.get(target, headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200 and reply.content == (trainer.weights_dir / NAME).read_bytes()
