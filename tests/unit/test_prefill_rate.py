"""The prompt rate the broker plans with: measured per prompt length, read off as a function of it."""
from __future__ import annotations

import pytest

from schemas import decode, encode
from schemas.messages import PrefillRate, WorkerInfo
from shared.runtime.prefill_rate import PrefillTimes, tokens_per_s


def test_prefills_of_different_lengths_keep_apart_and_the_same_length_averages():
    times = PrefillTimes()
    assert times.observe(2048, 2048 / 333) and times.observe(512, 512 / 400) and times.observe(4096, 4096 / 270)
    assert [(r.tokens, round(r.tokens_per_s)) for r in times.report()] == [(512, 400), (2048, 333), (4096, 270)]
    assert not times.observe(2000, 2000 / 300)  # the same bucket (≤ 2048): moves its averages by SMOOTHING (0.3)
    r = times.report()[1]
    assert r.tokens == round(0.7 * 2048 + 0.3 * 2000)
    assert r.tokens_per_s == pytest.approx(1 / (0.7 / 333 + 0.3 / 300), rel=1e-3)
    assert not times.observe(0, 1.0) and not times.observe(100, 0.0)  # nothing to learn from
    assert len(times.report()) == 3


def test_the_rate_for_a_length_is_interpolated_and_extrapolated_without_falling_below_the_measured():
    assert tokens_per_s([], 2048) == 0.0
    one = [PrefillRate(512, 400.0)]
    assert tokens_per_s(one, 100) == tokens_per_s(one, 4096) == 400.0  # one length: the rate is all we know
    rates = [PrefillRate(512, 400.0), PrefillRate(2048, 320.0)]
    assert tokens_per_s(rates, 512) == 400.0 and tokens_per_s(rates, 2048) == pytest.approx(320.0)
    assert tokens_per_s(rates, 64) == 400.0  # below the shortest: its rate
    mid = 1 / (1 / 400 + (1 / 320 - 1 / 400) * (1280 - 512) / (2048 - 512))  # time per token, linear in N
    assert tokens_per_s(rates, 1280) == pytest.approx(mid)
    assert tokens_per_s(rates, 4096) < 320.0  # above: slower still (attention grows with N)
    noisy = [PrefillRate(512, 300.0), PrefillRate(2048, 320.0)]  # the longer measured faster: no speed-up beyond
    assert tokens_per_s(noisy, 8192) == pytest.approx(320.0)
    close = [PrefillRate(1990, 346.0), PrefillRate(2050, 334.0)]  # a 3% span: its slope is noise, not attention
    assert tokens_per_s(close, 4096) == pytest.approx(334.0)
    wide = [PrefillRate(512, 400.0), PrefillRate(1990, 346.0), PrefillRate(2050, 334.0)]  # the slope from 512 on
    slope = (1 / 334 - 1 / 400) / (2050 - 512)
    assert tokens_per_s(wide, 4096) == pytest.approx(1 / (1 / 334 + slope * (4096 - 2050)))


def test_worker_info_carries_the_rates():
    info = WorkerInfo("prefill", "p1", 1, "h", "http://h:1", "0", prefill_rates=[PrefillRate(512, 401.5)])
    assert decode(WorkerInfo, encode(info)).prefill_rates == [PrefillRate(512, 401.5)]
