"""Free local ports for servers that this process starts and then polls until they listen.

A port from `bind(port 0)` comes from the kernel's ephemeral range, the same range it draws the source ports of
outgoing connections from. A readiness poll of `127.0.0.1:P` before the server has bound P can then be given P as
its own source port: the socket connects to itself (TCP simultaneous open), the poll reads its own request back as
the reply, and the server fails with "address already in use". Triton's start-up in the reward tests did exactly
that. Ports below the ephemeral range are never handed to outgoing connections, so only another listener can take
one, and each is handed out once per process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from reinforce.core.names import LOCAL_HOST

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below this sit well-known and registered services
LINUX_DEFAULT_EPHEMERAL_START = 32768

_handed_out: set[int] = set()
_random = random.SystemRandom()


def ephemeral_range_start() -> int:
    """The first port the kernel may give an outgoing connection (Linux's default where /proc does not say)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_EPHEMERAL_START


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOCAL_HOST) -> int:
    """A port that binds on `host` now, lies below the ephemeral range and was not handed out before here."""
    end = ephemeral_range_start()
    if end - LOWEST_PORT < 1000:  # an unusual kernel setting leaves no room below the range: let the kernel pick
        with socket.socket() as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    for _ in range(1000):
        port = _random.randrange(LOWEST_PORT, end)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} between {LOWEST_PORT} and {end} after 1000 tries")
