"""The weight endpoint both sides run: GET and HEAD /v1/weights/vNNNNNN.safetensors, on the standard library's
http.server, served by the trainer (trainer/weight_server.py, its published files) and by a relaying generator
(generator/relay.py, the version it is receiving).

http.server rather than the control planes' FastAPI: the body goes out with sendfile(2), so a 540 MB file is never
read into Python memory. A connection waits for its request in one shared thread (`_IdleConnections`: at most
MAX_IDLE of them, each for IDLE_TIMEOUT_S to send the whole request head, however slowly it trickles); only a whole
request takes one of MAX_CONNECTIONS threads, for that request, and a kept-alive connection goes back to wait. So
idle connections never hold the threads transfers need. It answers as those control planes do (core/http_kit.py):
the same constant-time bearer check (401 before the path is looked at, so an unauthenticated client learns nothing
about which versions exist) and every error's body {"detail": ...}.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import re
import selectors
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

from reinforce.core.http_kit import bearer_matches, error_body, unauthorized_detail
from reinforce.core.weights import FILE_NAME, WEIGHTS_ROUTE

log = logging.getLogger(__name__)

# The only names ever served: what weights.weight_path writes. Matched against the raw request target, never a decoded
# one, so "..", "%2F", "%00", query strings and other files of the folder (.tmp) cannot get through.
_REQUEST_TARGET = re.compile(re.escape(WEIGHTS_ROUTE) + r"(" + FILE_NAME.pattern + r")")
# The one form of Range request served: from an offset to the end (a relayed transfer resuming at another source).
_RANGE = re.compile(r"bytes=([0-9]{1,15})-")

# The weight endpoint's bounds: requests served at once (each one thread), connections waiting to send a request
# (the oldest is closed beyond), and how long one may take to send its request's head.
MAX_CONNECTIONS = 64
MAX_IDLE = 1024
IDLE_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 16384
_HEAD_END = b"\r\n\r\n"
_BUSY_BODY = error_body("every connection slot is taken: retry")
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


@dataclass
class _Waiting:
    sock: socket.socket
    address: tuple
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class _IdleConnections:
    """Connections waiting for their next request, all in one thread: each is handed to `dispatch(sock, address,
    bytes read)` once its request head is whole, or closed when its deadline passes, it closes, its head exceeds
    MAX_HEAD_BYTES, or `max_idle` newer ones wait (the oldest goes first)."""

    def __init__(self, dispatch: Callable[[socket.socket, tuple, bytes], None], timeout_s: float, max_idle: int):
        self.dispatch, self.timeout_s, self.max_idle = dispatch, timeout_s, max_idle
        self._selector = selectors.DefaultSelector()
        self._added: queue.SimpleQueue[tuple[socket.socket, tuple, bytes]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest first
        self._stopped = False
        threading.Thread(target=self._run, name="weight-idle-connections", daemon=True).start()

    def add(self, sock: socket.socket, address: tuple, pending: bytes = b"") -> None:
        """Wait for a request on `sock` (with `pending`: bytes of it already read)."""
        self._added.put((sock, address, pending))
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def _run(self) -> None:
        while not self._stopped:
            soonest = min((w.deadline for w in self._waiting.values()), default=time.monotonic() + self.timeout_s)
            for key, _ in self._selector.select(max(0.0, soonest - time.monotonic())):
                if key.fileobj is self._wake_read:
                    self._wake_read.recv(4096)
                else:
                    self._read(self._waiting[key.fileobj])  # type: ignore[index]
            self._take_added()
            now = time.monotonic()
            for waiting in [w for w in self._waiting.values() if w.deadline <= now]:
                self._close(waiting)
        for waiting in list(self._waiting.values()):
            self._close(waiting)

    def _take_added(self) -> None:
        while not self._added.empty():
            sock, address, pending = self._added.get()
            waiting = _Waiting(sock, address, time.monotonic() + self.timeout_s, bytearray(pending))
            if _HEAD_END in waiting.head:  # a pipelined request already read
                self._hand_over(sock, address, bytes(waiting.head))
                continue
            sock.setblocking(False)
            self._waiting[sock] = waiting
            self._selector.register(sock, selectors.EVENT_READ)
            while len(self._waiting) > self.max_idle:
                self._close(next(iter(self._waiting.values())))

    def _read(self, waiting: _Waiting) -> None:
        try:
            data = waiting.sock.recv(MAX_HEAD_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        waiting.head += data
        if not data or len(waiting.head) > MAX_HEAD_BYTES:
            self._close(waiting)
        elif _HEAD_END in waiting.head:
            self._forget(waiting)
            waiting.sock.setblocking(True)
            self._hand_over(waiting.sock, waiting.address, bytes(waiting.head))

    def _hand_over(self, sock: socket.socket, address: tuple, head: bytes) -> None:
        try:
            self.dispatch(sock, address, head)
        except Exception:  # no thread for it (dispatch closed it): the other connections still wait here
            log.exception("weight endpoint: cannot serve a request from %s", address)

    def _forget(self, waiting: _Waiting) -> None:
        self._selector.unregister(waiting.sock)
        del self._waiting[waiting.sock]

    def _close(self, waiting: _Waiting) -> None:
        self._forget(waiting)
        with contextlib.suppress(OSError):
            waiting.sock.close()


class WeightHTTPServer(ThreadingHTTPServer):
    """Serves `weights_dir` with `handler` (WeightHandler or a subclass); with `token`, every request needs
    `Authorization: Bearer <token>`. A connection waits for its request among the idle ones (`_IdleConnections`:
    `idle_timeout_s` to send its head, at most `max_idle` of them); a request beyond `max_connections` served at once
    is answered 503 and its connection closed (the generators' fetch retries it)."""

    daemon_threads = True  # a stalled download must not keep the trainer from exiting
    request_queue_size = 128  # listen backlog: many generators connect at once when a version is published

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[WeightHandler],
        weights_dir: Path,
        token: str | None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_idle: int = MAX_IDLE,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.weights_dir = weights_dir
        self.token = token or None  # None or empty: every request is served
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # requests answered 503 because every slot was taken
        self._heads: dict[socket.socket, bytes] = {}  # a dispatched connection's request head, for its handler
        # connections kept alive (their address, what of their next request was read): once their thread is done
        self._kept: dict[socket.socket, tuple[tuple, bytes]] = {}
        self.idle = _IdleConnections(self._dispatch, idle_timeout_s, max_idle)
        super().__init__(address, handler)

    def serve_in_thread(self, name: str) -> threading.Thread:
        """Serve in a started daemon thread; shutdown() ends it."""
        # a short poll interval only so that shutdown() returns promptly; the wake-ups cost nothing measurable
        thread = threading.Thread(target=self.serve_forever, args=(0.05,), name=name, daemon=True)
        thread.start()
        return thread

    def process_request(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        """A new connection waits for its request among the idle ones."""
        self.idle.add(request, client_address)

    def _dispatch(self, request: socket.socket, client_address: tuple, head: bytes) -> None:
        """A whole request head arrived: a thread for the request if a slot is free; otherwise 503, and close."""
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        self._heads[request] = head
        try:
            super().process_request(request, client_address)
        except Exception:  # no thread could be started: the slot is not taken after all
            self._slots.release()
            self._heads.pop(request, None)
            self.shutdown_request(request)
            raise

    def take_head(self, request: socket.socket) -> bytes:
        return self._heads.pop(request)

    def keep_alive(self, request: socket.socket, client_address: tuple, pending: bytes) -> None:
        """Once its thread is done, the connection waits for its next request (`pending`: what of it was read)."""
        self._kept[request] = (client_address, pending)

    def _refuse(self, request: socket.socket) -> None:
        self.refused += 1
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning("weight endpoint busy (%d connections): %d refused so far", self.max_connections, self.refused)
        with contextlib.suppress(OSError):  # a few bytes into an empty send buffer: never blocks for long
            request.settimeout(1.0)
            request.sendall(_BUSY)
        self.shutdown_request(request)

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        kept = self._kept.pop(request, None)
        if kept is None:
            super().shutdown_request(request)
        else:  # its thread is done with it: it waits for its next request
            self.idle.add(request, *kept)

    def server_close(self) -> None:
        self.idle.stop()
        super().server_close()

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn, a reverse DNS lookup that can hang in a pod.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class WeightHandler(BaseHTTPRequestHandler):
    """GET and HEAD of a published file of the server's weights_dir, whole (200) or from `Range: bytes=N-` (206)."""

    server: WeightHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 60  # per socket operation of a transfer: a client that stops reading frees its thread

    def setup(self) -> None:
        super().setup()
        # the request head, whole, as the idle connections read it: what follows it is the next request's
        self.rfile = io.BytesIO(self.server.take_head(self.connection))

    def handle(self) -> None:
        """One request; a kept-alive connection then waits for its next one among the idle ones, not here."""
        self.handle_one_request()
        if not self.close_connection:
            self.wfile.flush()
            self.server.keep_alive(self.connection, self.client_address, self.rfile.read())

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _serve(self, send_body: bool) -> None:
        self.connection.settimeout(self.timeout)  # the request is in: the transfer's timeout from here on
        token = self.server.token
        if token is not None and not bearer_matches(self.headers.get("Authorization"), token):
            self.send_error(HTTPStatus.UNAUTHORIZED, unauthorized_detail("weights token"))
            return
        match = _REQUEST_TARGET.fullmatch(self.path)
        if match is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        offset = self._range_start()
        if offset is None:
            self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "only Range: bytes=N- is served")
            return
        self.send_named(match.group(1), offset, send_body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every error, this handler's and http.server's own (a malformed request line), with the control planes'
        body {"detail": message} (core/http_kit.py) rather than http.server's HTML page; the connection closes."""
        self.log_error("code %d, message %s", code, message)
        status = HTTPStatus(code)
        body = error_body(message or status.phrase)
        self.send_response(status)
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _range_start(self) -> int | None:
        """The offset a `Range: bytes=N-` asks for (0 without one); None for any other Range."""
        wanted = self.headers.get("Range")
        if wanted is None:
            return 0
        match = _RANGE.fullmatch(wanted.strip())
        return int(match.group(1)) if match else None

    def send_named(self, name: str, offset: int, send_body: bool) -> None:
        """The file `name` of weights_dir from `offset` on (a relay's handler serves its transfer instead)."""
        fd = self._open(name)
        if fd is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        with os.fdopen(fd, "rb") as f:
            self._send_file(f, offset, send_body)

    def send_head(self, size: int, offset: int) -> bool:
        """The status and headers of bytes offset..size-1 of a file: 200 for all of it, 206 for a tail, 416 past
        its end (False: nothing more to send)."""
        if offset and offset >= size:
            self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            return False
        self.send_response(206 if offset else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - offset))
        if offset:
            self.send_header("Content-Range", f"bytes {offset}-{size - 1}/{size}")
        self.end_headers()
        return True

    def _open(self, name: str) -> int | None:
        """An open descriptor of weights_dir/name, or None. Opening first means pruning cannot cut a download."""
        try:
            # O_NOFOLLOW: a symlink planted in the folder cannot point the server at another file.
            fd = os.open(self.server.weights_dir / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def _send_file(self, f: BinaryIO, offset: int, send_body: bool) -> None:
        size = os.fstat(f.fileno()).st_size
        if not self.send_head(size, offset) or not send_body:
            return
        try:
            self.connection.sendfile(f, offset, size - offset)
        except OSError as err:  # the client went away (a restarting generator): nothing to clean up
            log.debug("weight download of %s ended early: %s", self.path, err)
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)
