"""tools/bench/cpu_window.py on this machine's /proc: CPU spent between a request's second and last token counts
for the process that spent it and for the machine; none before the second token."""
from __future__ import annotations

import os
import sys
import time

import pytest

from tools.bench.cpu_window import DecodeCpu, stack_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_the_window_counts_cpu_from_the_second_token_to_the_last():
    window = DecodeCpu({"me": [os.getpid()]})
    window.on_token(0)
    _burn(0.3)  # before the window: TTFT's part
    window.on_token(1)
    _burn(0.2)
    window.on_token(2)
    _burn(0.2)
    window.on_token(3)
    spent = window.seconds()
    assert 0.3 <= spent["me"] < 0.55  # 0.4 s, at the clock tick's resolution
    assert spent["machine"] >= spent["me"] - 0.05


def test_a_short_stream_has_no_window_and_gone_workers_are_left_out():
    window = DecodeCpu({"me": [os.getpid()]})
    window.on_token(0)
    window.on_token(1)
    assert window.seconds() == {}
    workers = [{"role": "decode", "pid": os.getpid()}, {"role": "prefill", "pid": 2 ** 22 + 7}, {"role": "x"}]
    assert stack_pids(workers) == {"decode": [os.getpid()]}
