"""tools/netns_link.sh: the TCP data plane between two network namespaces over a `tc tbf`-shaped veth."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "netns_link.sh"
PEER = textwrap.dedent("""
    import asyncio, sys, time
    from shared.dataplane import Grant, Segment
    from shared.dataplane.tcp import TcpDataPlane
    SIZE = 8 << 20
    async def main(role):
        plane = TcpDataPlane(host=sys.argv[2], port=47011)
        plane.register_region(memoryview(bytearray(SIZE)))
        await plane.start()
        plane.grant(Grant(1, [(0, SIZE)]))
        if role == "receiver":
            await asyncio.sleep(20)
        else:
            await plane.push("169.254.77.2:47011", 1, [Segment(0, 0, 1 << 20)])
            started = time.monotonic()
            await plane.push("169.254.77.2:47011", 1, [Segment(0, 0, SIZE)])
            print(SIZE * 8 / (time.monotonic() - started) / 1e9)
        await plane.close()
    asyncio.run(main(sys.argv[1]))
""")


@pytest.fixture
def link():
    if os.geteuid() != 0:
        pytest.skip("netns_link needs root")
    subprocess.run([SCRIPT, "down"], check=False)
    up = subprocess.run([SCRIPT, "up", "200mbit"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.skip(f"network namespaces unavailable here: {up.stderr.strip()}")
    yield
    subprocess.run([SCRIPT, "down"], check=True)


def test_push_across_a_shaped_veth_runs_at_the_tbf_rate(link):
    """An 8 MiB push from one namespace to the other moves at about the tbf rate (200 Mbit/s)."""
    cwd = SCRIPT.parents[1]
    receiver = subprocess.Popen(["ip", "netns", "exec", "sg_decode", sys.executable, "-c", PEER, "receiver",
                                 "169.254.77.2"], cwd=cwd)
    try:
        import time

        time.sleep(1.5)
        out = subprocess.run(["ip", "netns", "exec", "sg_prefill", sys.executable, "-c", PEER, "sender",
                              "169.254.77.1"], cwd=cwd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        gbps = float(out.stdout.strip().splitlines()[-1])
        assert 0.15 < gbps < 0.21, gbps
    finally:
        receiver.kill()
        receiver.wait()
