"""reinforce.supervisor.ports: ports that an outgoing connection can never be given while a server starts."""

from __future__ import annotations

import socket

from reinforce.supervisor import ports


def test_ports_lie_below_the_ephemeral_range_bind_and_are_not_repeated() -> None:
    start = ports.ephemeral_range_start()
    handed = [ports.free_port() for _ in range(200)]
    assert len(set(handed)) == len(handed)
    assert all(ports.LOWEST_PORT <= port < start for port in handed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", handed[-1]))


def test_a_listening_port_is_never_handed_out(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        choices = iter([busy, *range(20000, 30000)])
        monkeypatch.setattr(ports, "LOWEST_PORT", 1024)
        monkeypatch.setattr(ports, "ephemeral_range_start", lambda: 65535)
        monkeypatch.setattr(ports._random, "randrange", lambda low, high: next(choices))
        assert ports.free_port() != busy
