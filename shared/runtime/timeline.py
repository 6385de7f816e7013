"""Per-request latency figures from token timestamps (docs/architecture.md, "Metrics").

`token_times_s[i]` is the time of completion token i+1 measured from arrival t0, in seconds:
    TTFT   = t1 - t0
    TTST   = t2 - t1          (the stall between prefill and decode that SmartGen attacks)
    TBT    = mean(t_{i+1} - t_i) for i >= 2
    CTL(i) = t_i - t0
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timeline:
    ttft_s: float | None
    ttst_s: float | None
    tbt_s: float | None

    @classmethod
    def of(cls, token_times_s: Sequence[float]) -> "Timeline":
        t = list(token_times_s)
        if any(b < a for a, b in zip(t, t[1:])):
            raise ValueError("token times must not decrease")
        gaps = [b - a for a, b in zip(t[1:], t[2:])]
        return cls(
            ttft_s=t[0] if t else None,
            ttst_s=t[1] - t[0] if len(t) > 1 else None,
            tbt_s=sum(gaps) / len(gaps) if gaps else None,
        )


def ctl(token_times_s: Sequence[float], index: int) -> float:
    """Cumulative token latency of token `index` (1-based, as in the paper)."""
    return token_times_s[index - 1]
