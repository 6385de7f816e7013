"""`free_port` hands out ports that no bind(0) can take before their owner binds them."""
from __future__ import annotations

import socket

from tools.nats_server import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """Twenty ports: all different, each bindable now, none where the kernel picks ports for bind(0); and a
    thousand bind(0)s meanwhile (what a stack's services do) never land on one of them."""
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    kernel_picks = set()
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            kernel_picks.add(s.getsockname()[1])
    assert not kernel_picks & set(ports)
