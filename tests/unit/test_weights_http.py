"""Weights fetched over HTTP from the trainer's WeightServer: streamed, verified, refused when wrong."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import torch
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from transformers import LlamaConfig, LlamaForCausalLM

from reinforce.core import weights as weights_module
from reinforce.core.http_kit import bearer_dependency
from reinforce.core.records_pb2 import WeightVersion
from reinforce.core.weight_http import WeightHandler, WeightHTTPServer
from reinforce.core.weights import (
    LoadStats,
    WeightError,
    WeightSources,
    load_verified,
    module_loader,
    publish,
    weight_path,
)
from reinforce.trainer.weight_server import WeightServer

TOKEN = "s3cret-token"


def tiny_model(seed: int, hidden_size: int = 16, vocab_size: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def copy_of(weights: WeightVersion, **changes: object) -> WeightVersion:
    out = WeightVersion()
    out.CopyFrom(weights)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """(the trainer's weights folder, a generator's download folder): no shared volume between them."""
    return tmp_path / "trainer" / "weights", tmp_path / "generator" / "cache"


@pytest.fixture
def server(dirs: tuple[Path, Path]) -> Iterator[WeightServer]:
    with WeightServer(dirs[0], host="127.0.0.1") as srv:
        yield srv


@pytest.fixture
def secured(dirs: tuple[Path, Path]) -> Iterator[WeightServer]:
    with WeightServer(dirs[0], host="127.0.0.1", token=TOKEN) as srv:
        yield srv


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_module, "RETRY_BACKOFF_S", (0.01, 0.01))


NAME = "v000001.safetensors"  # version 1's file


def publish_served(server: WeightServer, model: torch.nn.Module, version: int, keep: int = 3) -> WeightVersion:
    return publish(model, server.weights_dir, version, keep=keep, base_url=server.base_url("127.0.0.1"))


def sources(server: WeightServer) -> WeightSources:
    """A generator's allowed sources: the trainer's weight endpoint (and its folder, were it shared)."""
    return WeightSources(server.weights_dir, server.base_url("127.0.0.1"))


def raw_get(port: int, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """A request whose target goes on the wire byte for byte (httpx would normalise '..' segments)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", target, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_round_trip_over_http(server: WeightServer, dirs: tuple[Path, Path]):
    source, target = tiny_model(0), tiny_model(1)
    published = publish_served(server, source, version=5)
    path = weight_path(server.weights_dir, 5)
    assert (
        published.uri
        == server.url_for(path, "127.0.0.1")
        == f"http://127.0.0.1:{server.port}/v1/weights/v000005.safetensors"
    )
    stats = load_verified(module_loader(target), published, sources(server), cache_dir=dirs[1])
    assert same_weights(source, target)
    assert isinstance(stats, LoadStats) and stats.num_bytes == path.stat().st_size == published.num_bytes
    assert stats.fetch_seconds > 0 and stats.load_seconds > 0
    assert list(dirs[1].iterdir()) == []  # the temporary download is gone


def test_file_uri_still_works_and_reports_stats(tmp_path: Path):
    source, target = tiny_model(0), tiny_model(1)
    published = publish(source, tmp_path, version=1)
    assert published.uri == str(weight_path(tmp_path, 1).resolve())
    stats = load_verified(module_loader(target), published, WeightSources(tmp_path))
    assert same_weights(source, target) and stats.num_bytes == published.num_bytes


def test_tampered_digest_is_refused_before_touching_the_model(server: WeightServer, dirs: tuple[Path, Path]):
    target = tiny_model(1)
    before = snapshot(target)
    published = publish_served(server, tiny_model(0), version=2)
    with pytest.raises(WeightError) as err:
        load_verified(module_loader(target), copy_of(published, sha256="0" * 64), sources(server), cache_dir=dirs[1])
    message = str(err.value)
    assert "weight version 2" in message and published.uri in message
    assert published.sha256 not in message  # the file's digest is never echoed (it would hash any file)
    assert unchanged(target, before) and list(dirs[1].iterdir()) == []


def test_bytes_corrupted_on_disk_after_publish_are_refused(server: WeightServer, dirs: tuple[Path, Path]):
    target = tiny_model(1)
    before = snapshot(target)
    published = publish_served(server, tiny_model(0), version=3)
    path = weight_path(server.weights_dir, 3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same length, one tensor byte flipped: only the digest can tell
    path.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="sha256"):
        load_verified(module_loader(target), published, sources(server), cache_dir=dirs[1])
    assert unchanged(target, before) and list(dirs[1].iterdir()) == []


def test_pruned_version_is_404_naming_the_version(server: WeightServer, dirs: tuple[Path, Path]):
    model = tiny_model(0)
    old = publish_served(server, model, version=1, keep=1)
    publish_served(server, model, version=2, keep=1)  # prunes v1
    assert not weight_path(server.weights_dir, 1).exists()
    with pytest.raises(WeightError, match=r"weight version 1: .*v000001\.safetensors: HTTP 404"):
        load_verified(module_loader(tiny_model(1)), old, sources(server), cache_dir=dirs[1])


def test_token_is_required(secured: WeightServer, dirs: tuple[Path, Path]):
    source, target = tiny_model(0), tiny_model(1)
    published = publish_served(secured, source, version=1)
    assert httpx.get(published.uri).status_code == 401
    assert httpx.get(published.uri, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(published.uri, headers={"Authorization": TOKEN}).status_code == 401  # no "Bearer "
    with pytest.raises(WeightError, match="HTTP 401"):
        load_verified(module_loader(target), published, sources(secured), cache_dir=dirs[1])
    with pytest.raises(WeightError, match="HTTP 401"):
        load_verified(module_loader(target), published, sources(secured), cache_dir=dirs[1], token="wrong")
    load_verified(module_loader(target), published, sources(secured), cache_dir=dirs[1], token=TOKEN)
    assert same_weights(source, target)


def test_the_token_check_and_error_bodies_are_the_control_planes(secured: WeightServer):
    """The weight endpoint (http.server) decides every Authorization header as the FastAPI control planes'
    bearer_dependency does, and its errors carry their body, {"detail": ...}, not http.server's HTML page."""
    published = publish_served(secured, tiny_model(0), version=1)
    app = FastAPI()
    app.get("/v1/weights/{name}", dependencies=[Depends(bearer_dependency(TOKEN, "weights token"))])(lambda name: {})
    kit = TestClient(app)
    for header in (
        None,
        "",
        "Bearer wrong",
        TOKEN,
        f"bearer {TOKEN}",
        f"Bearer {TOKEN}x",
        f"Bearer  {TOKEN}",
        f"Bearer {TOKEN}",
    ):
        headers = {} if header is None else {"Authorization": header}
        ours, theirs = httpx.get(published.uri, headers=headers), kit.get(urlsplit(published.uri).path, headers=headers)
        assert ours.status_code == theirs.status_code, header
        if ours.status_code == 401:
            assert ours.json() == theirs.json() == {"detail": "missing or wrong weights token"}
            assert ours.headers["www-authenticate"] == "Bearer"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    missing = httpx.get(published.uri.replace("v000001", "v000099"), headers=auth)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    ranged = httpx.get(published.uri, headers={**auth, "Range": "bytes=0-10"})
    assert ranged.status_code == 416 and ranged.json() == {"detail": "only Range: bytes=N- is served"}
    head = httpx.head(published.uri)
    assert head.status_code == 401 and head.content == b""  # HEAD: the headers alone


@pytest.mark.parametrize(
    "target",
    [
        "/v1/weights/..%2F..%2Fetc%2Fpasswd",
        "/v1/weights/../../etc/passwd",
        "/v1/weights/../../secret.safetensors",
        "/v1/weights/..%2F..%2Fsecret.safetensors",
        "/v1/weights/%2e%2e/%2e%2e/secret.safetensors",
        "/v1/weights/v000001.safetensors/../../../secret.safetensors",
        "/v1/weights/v000001%2Esafetensors",
        "/v1/weights/v000001.safetensors%00",
        "/v1/weights/v000001.safetensors?x=1",
        "/v1/weights//etc/passwd",
        "/v1/weights/v1.safetensors",
        "/v1/weights/v000001.tmp",
        "/v1/weights/",
        "/v1/weights/v000099.safetensors",
        "/etc/passwd",
        "//etc/passwd",
    ],
)
def test_nothing_outside_the_published_files_is_served(server: WeightServer, target: str):
    secret = server.weights_dir.parent.parent / "secret.safetensors"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(b"SECRET-MARKER")
    publish_served(server, tiny_model(0), version=1)
    (server.weights_dir / "v000001.tmp").write_bytes(b"SECRET-MARKER")
    status, body = raw_get(server.port, target)
    assert status in (400, 404) and b"SECRET-MARKER" not in body


def test_symlink_planted_in_the_folder_is_not_followed(server: WeightServer, tmp_path: Path):
    publish_served(server, tiny_model(0), version=1)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"SECRET-MARKER")
    (server.weights_dir / "v000007.safetensors").symlink_to(outside)
    status, body = raw_get(server.port, "/v1/weights/v000007.safetensors")
    assert status == 404 and b"SECRET-MARKER" not in body


def test_unauthenticated_requests_learn_nothing(secured: WeightServer):
    publish_served(secured, tiny_model(0), version=1)
    assert raw_get(secured.port, "/v1/weights/v000001.safetensors")[0] == 401
    assert raw_get(secured.port, "/v1/weights/v000099.safetensors")[0] == 401  # not 404: existence hidden
    assert raw_get(secured.port, "/v1/weights/..%2F..%2Fetc%2Fpasswd")[0] == 401


def test_multi_megabyte_file_streams_intact(server: WeightServer, dirs: tuple[Path, Path]):
    source, target = tiny_model(0, hidden_size=512, vocab_size=2048), tiny_model(1, hidden_size=512, vocab_size=2048)
    published = publish_served(server, source, version=4)
    size = weight_path(server.weights_dir, 4).stat().st_size
    assert size > 5 << 20  # several of the server's and client's chunks
    head = httpx.head(published.uri)
    assert head.status_code == 200 and int(head.headers["content-length"]) == size
    stats = load_verified(module_loader(target), published, sources(server), cache_dir=dirs[1])
    assert same_weights(source, target) and stats.num_bytes == size


def test_http_uri_needs_a_cache_dir(server: WeightServer):
    published = publish_served(server, tiny_model(0), version=1)
    with pytest.raises(ValueError, match="cache_dir"):
        load_verified(module_loader(tiny_model(1)), published, sources(server))


def test_a_body_longer_than_published_is_cut_off(server: WeightServer, dirs: tuple[Path, Path]):
    target = tiny_model(1)
    before = snapshot(target)
    published = publish_served(server, tiny_model(0), version=1)
    with pytest.raises(WeightError, match="more than the published 100 bytes"):
        load_verified(module_loader(target), copy_of(published, num_bytes=100), sources(server), cache_dir=dirs[1])
    assert unchanged(target, before) and list(dirs[1].iterdir()) == []


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503, then cuts the body short, then serves the file: what a restarting trainer pod looks like."""

    protocol_version = "HTTP/1.1"
    payload = b""
    calls: list[str]

    def do_GET(self) -> None:
        self.calls.append(self.path)
        if len(self.calls) == 1:
            self.send_error(503)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(self.payload if len(self.calls) > 2 else self.payload[: len(self.payload) // 2])

    def log_message(self, *args: object) -> None:
        pass


def test_transient_failures_are_retried(tmp_path: Path, dirs: tuple[Path, Path], fast_retries: None):
    source, target = tiny_model(0), tiny_model(1)
    published = publish(source, tmp_path, version=6)
    handler = type("Flaky", (_Flaky,), {"payload": Path(published.uri).read_bytes(), "calls": []})
    flaky = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=flaky.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{flaky.server_address[1]}/v1/weights/v000006.safetensors"
        allowed = WeightSources(tmp_path, f"http://127.0.0.1:{flaky.server_address[1]}")
        stats = load_verified(module_loader(target), copy_of(published, uri=url), allowed, cache_dir=dirs[1])
    finally:
        flaky.shutdown()
        flaky.server_close()
    assert len(handler.calls) == 3 and same_weights(source, target)
    assert stats.num_bytes == published.num_bytes and list(dirs[1].iterdir()) == []


def test_unreachable_server_gives_up_naming_the_url(dirs: tuple[Path, Path], fast_retries: None):
    with WeightServer(dirs[0], host="127.0.0.1") as srv:
        published = publish_served(srv, tiny_model(0), version=1)
        allowed = sources(srv)
    # the server is stopped now: its port refuses connections
    with pytest.raises(
        WeightError, match=r"weight version 1: cannot fetch http://127\.0\.0\.1:\d+/.* after 3 attempts"
    ):
        load_verified(module_loader(tiny_model(1)), published, allowed, cache_dir=dirs[1])
    assert list(dirs[1].iterdir()) == []


def test_url_for_refuses_other_names(server: WeightServer):
    with pytest.raises(ValueError):
        server.url_for(Path("/etc/passwd"), "127.0.0.1")
    assert server.base_url("fd00::1") == f"http://[fd00::1]:{server.port}"


def test_a_uri_outside_the_runs_sources_is_refused_untouched(server: WeightServer, dirs: tuple[Path, Path]):
    """Issue #13, finding 2: the token goes to the run's trainer only, and no other file is read or hashed."""
    requests: list[str] = []
    spy = ThreadingHTTPServer(("127.0.0.1", 0), type("Spy", (_Flaky,), {"calls": requests}))
    threading.Thread(target=spy.serve_forever, daemon=True).start()
    published = publish_served(server, tiny_model(0), version=1)
    elsewhere = f"http://127.0.0.1:{spy.server_address[1]}/v1/weights/v000001.safetensors"
    passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    try:
        for uri in (elsewhere, "/etc/passwd", str(dirs[0].parent / "v000001.safetensors"), published.uri + "x"):
            with pytest.raises(WeightError, match="is not this run's") as err:
                load_verified(module_loader(tiny_model(1)), copy_of(published, uri=uri), sources(server),
                              cache_dir=dirs[1], token=TOKEN)  # fmt: skip
            assert passwd not in str(err.value) and TOKEN not in str(err.value)
    finally:
        spy.shutdown()
        spy.server_close()
    assert requests == []  # the spy host was never contacted, let alone sent the token


def test_a_wrong_file_in_the_folder_is_refused_without_its_digest(tmp_path: Path):
    published = publish(tiny_model(0), tmp_path, version=1)
    other = tmp_path / "v000002.safetensors"
    other.write_bytes(b"not the published bytes")
    forged = copy_of(published, version=2, uri=str(other.resolve()))
    with pytest.raises(WeightError, match="does not match") as err:
        load_verified(module_loader(tiny_model(1)), forged, WeightSources(tmp_path))
    assert hashlib.sha256(b"not the published bytes").hexdigest() not in str(err.value)


def _server_threads() -> int:
    return sum(t.name.startswith("Thread-") for t in threading.enumerate())  # socketserver's per-connection threads


def _trickle(sock: socket.socket, request: bytes, every_s: float) -> None:
    """Send `request` a byte at a time, until the server closes the connection."""
    with contextlib.suppress(OSError):
        for byte in request:
            sock.sendall(bytes([byte]))
            time.sleep(every_s)


def test_idle_connections_never_hold_the_threads_a_download_needs(dirs: tuple[Path, Path]):
    """Issue #30, R3-12, and the red team's R4-15: idle connections held the threads (64 of them answered everyone
    else 503, and a client reconnecting every 4.9 s kept it so). Here 40 idle connections and one that trickles its
    request a byte at a time hold none of max_connections 4: a download goes through while they wait, and each is
    closed idle_timeout_s after it connected, the trickling one too."""
    with WeightServer(dirs[0], host="127.0.0.1", max_connections=4, idle_timeout_s=2.0) as srv:
        published = publish_served(srv, tiny_model(0), version=1)
        before = _server_threads()
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(40)]
        slow = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        start = time.monotonic()
        request = f"GET /v1/weights/{NAME} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        threading.Thread(target=_trickle, args=(slow, request, 0.05), name="trickle", daemon=True).start()
        try:
            time.sleep(0.5)
            assert _server_threads() == before  # waiting connections take no request thread
            target = tiny_model(1)
            load_verified(module_loader(target), published, sources(srv), cache_dir=dirs[1])
            assert same_weights(tiny_model(0), target)
            assert all(sock.recv(64) == b"" for sock in [*idle, slow])  # closed, none answered
            assert 2.0 <= time.monotonic() - start < 4.0
        finally:
            for sock in [*idle, slow]:
                sock.close()


def test_beyond_max_idle_the_oldest_waiting_connection_is_closed(tmp_path: Path):
    server = WeightHTTPServer(("127.0.0.1", 0), WeightHandler, tmp_path, None, idle_timeout_s=30.0, max_idle=8)
    server.serve_in_thread("test-weights")
    try:
        waiting = [socket.create_connection(server.server_address, timeout=5) for _ in range(12)]
        assert all(sock.recv(64) == b"" for sock in waiting[:4])  # the oldest four, at once
        for sock in waiting[4:]:
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                sock.recv(64)  # still waiting for their request
        waiting[-1].settimeout(5)
        waiting[-1].sendall(b"GET /v1/weights/v000001.safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
        assert waiting[-1].recv(64).startswith(b"HTTP/1.1 404 ")
    finally:
        server.shutdown()
        server.server_close()


def test_a_fetch_rides_out_a_busy_endpoint(dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog):
    """A 503 from a full endpoint is retried: the download succeeds once a slot frees. The only slot is a download
    of a 64 MiB file its client does not read, until it lets go a second later."""
    monkeypatch.setattr(weights_module, "RETRY_BACKOFF_S", (0.5, 0.5, 0.5, 0.5))
    caplog.set_level(logging.WARNING, logger="reinforce.core.weight_http")
    with WeightServer(dirs[0], host="127.0.0.1", max_connections=1) as srv:
        published = publish_served(srv, tiny_model(0), version=1)
        (dirs[0] / "v000009.safetensors").write_bytes(bytes(64 << 20))
        holder = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        holder.sendall(b"GET /v1/weights/v000009.safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
        assert holder.recv(64).startswith(b"HTTP/1.1 200 ")  # its thread is sending, blocked on the full socket
        threading.Timer(1.0, holder.close).start()
        target = tiny_model(1)
        load_verified(module_loader(target), published, sources(srv), cache_dir=dirs[1])
    assert same_weights(tiny_model(0), target)
    assert "weight endpoint busy (1 connections): 1 refused so far" in caplog.text
