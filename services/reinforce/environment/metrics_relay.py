"""Prometheus' way to the environment service's metrics in docker-compose, whose environment container has no network.

    python -m reinforce.environment.metrics_relay --uds /run/reinforce-environment/api.sock --port N [--host H]

Answers GET /metrics on a TCP port with what the service answers to GET /metrics on its Unix socket, and nothing
else (404 for every other path, 502 when the socket does not answer). It holds no token: /metrics is open on the
service too. Run beside the service, on the network, with the socket's volume read-only (compose/tools.yml, profile
monitoring); the service's container keeps `network_mode: none`, so the code its tools run still reaches no network.

What it relays is capped (MAX_METRICS_BYTES) and timed (TIMEOUT_S), whatever answers on the socket: a service that
hangs must not hang the relay. In docker-compose the tools' code cannot replace the socket: the service binds it as
root in a root-owned folder before it becomes the user that code runs as (--run-as, docker-compose.yml). Where that
code may write into the socket's folder (a service started without --run-as, in a folder of its own user), it could
put a listener of its own there: what that answers reaches Prometheus as scraped text, a channel out no wider than a
tool's own output, which goes to the generators by design, and the caps keep it from flooding or hanging the relay.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from reinforce.core.environment_client import UNIX_BASE_URL
from reinforce.core.names import LOCAL_HOST, METRICS_PATH

log = logging.getLogger("reinforce.environment.metrics_relay")
MAX_METRICS_BYTES = 1 << 20  # the service's metrics are a few KB; a bigger answer is not its own
TIMEOUT_S = 5.0


class MetricsTooLarge(ValueError):
    """The socket answered more than MAX_METRICS_BYTES."""


def fetch_metrics(socket_path: str) -> tuple[bytes, str]:
    """GET /metrics over the Unix socket: (body, content type); httpx.HTTPError when it does not answer 200."""
    transport = httpx.HTTPTransport(uds=socket_path)
    with (
        httpx.Client(transport=transport, base_url=UNIX_BASE_URL, timeout=TIMEOUT_S) as client,
        client.stream("GET", METRICS_PATH) as response,
    ):
        response.raise_for_status()
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > MAX_METRICS_BYTES:
                raise MetricsTooLarge(f"more than {MAX_METRICS_BYTES} bytes from {socket_path}")
        return bytes(body), response.headers.get("content-type", "text/plain")


def handler(socket_path: str) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != METRICS_PATH:
                self.send_error(404)
                return
            try:
                body, content_type = fetch_metrics(socket_path)
            except (httpx.HTTPError, MetricsTooLarge) as err:
                self.send_error(502, explain=str(err))
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug(format, *args)  # a line per scrape would drown the log

    return Relay


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser("python -m reinforce.environment.metrics_relay", description=__doc__)
    parser.add_argument("--uds", required=True, help="the environment service's Unix socket")
    parser.add_argument("--port", type=int, required=True, help="the port Prometheus scrapes")
    parser.add_argument("--host", default=LOCAL_HOST, help=f"bind address (default {LOCAL_HOST})")
    args = parser.parse_args(argv)
    # PID 1 of its container: a signal without a handler is ignored, and `docker stop` would wait out its grace period
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = ThreadingHTTPServer((args.host, args.port), handler(args.uds))
    log.info("relaying %s of %s on %s:%d", METRICS_PATH, args.uds, args.host, args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
