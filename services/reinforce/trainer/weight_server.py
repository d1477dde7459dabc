"""The trainer's weight endpoint: its published `v*.safetensors` files at GET /v1/weights/{file}, for generators that
share no volume with it (weights.transport http)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from reinforce.core.names import LOCAL_HOST
from reinforce.core.weight_http import IDLE_TIMEOUT_S, MAX_CONNECTIONS, WeightHandler, WeightHTTPServer
from reinforce.core.weights import FILE_NAME, WEIGHTS_ROUTE

log = logging.getLogger(__name__)


class WeightServer:
    """Serves the published `v*.safetensors` files of `weights_dir` at GET /v1/weights/{file}, in a thread.

    core/weight_http.py's server: one thread per request, at most `max_connections` of them (a request beyond is
    answered 503 and its connection closed: the generators' fetch retries it), and the body goes out with sendfile(2),
    so a 540 MB file is never read into Python memory. `Range: bytes=N-` is served (206): a relayed transfer whose
    relay failed resumes here at its first unverified byte (generator/relay.py). A connection waits for its request
    in one shared thread and is closed if its head is not whole within `idle_timeout_s`, so idle ones cannot hold
    the request threads. With `token`, every request needs
    `Authorization: Bearer <token>` (401 otherwise), checked before the path so unauthenticated clients learn
    nothing about which versions exist.
    """

    def __init__(
        self,
        weights_dir: Path,
        host: str = LOCAL_HOST,
        port: int = 0,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.weights_dir = weights_dir.resolve()
        self.host = host
        self.requested_port = port
        self.token = token
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._server: WeightHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("WeightServer is not started")
        return self._server.server_address[1]

    def start(self) -> int:
        """Bind, serve in a daemon thread, and return the bound port (useful with port=0)."""
        if self._server is not None:
            raise RuntimeError("WeightServer already started")
        self._server = WeightHTTPServer(
            (self.host, self.requested_port), WeightHandler, self.weights_dir, self.token,
            self.max_connections, self.idle_timeout_s,
        )  # fmt: skip
        self._thread = self._server.serve_in_thread("weight-server")
        log.info("serving %s on %s:%d", self.weights_dir, self.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server, self._thread = None, None

    def base_url(self, advertise_host: str) -> str:
        """What generators reach this server at, e.g. the pod IP or a Service name; pass it to publish()."""
        host = f"[{advertise_host}]" if ":" in advertise_host and not advertise_host.startswith("[") else advertise_host
        return f"http://{host}:{self.port}"

    def url_for(self, path: Path, advertise_host: str) -> str:
        """The WeightVersion.uri of a published file of weights_dir."""
        if not FILE_NAME.fullmatch(path.name):
            raise ValueError(f"{path.name} is not a published weight file name")
        return f"{self.base_url(advertise_host)}{WEIGHTS_ROUTE}{path.name}"

    def __enter__(self) -> WeightServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
