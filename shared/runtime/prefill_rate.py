"""How fast one prefill worker prefills a prompt of N tokens, as a function of N.

A prefill's time grows faster than N (attention is quadratic in it): on the development CPU SmolLM2 prefills
~380 tokens/s at 512 tokens, 333 at 2K and 270 at 4K. One moving average over prompts of mixed lengths
mis-plans every one of them, and a worker that has not prefilled yet gives the broker nothing to plan with. So:

- the prefill worker keeps, per length bucket (the next power of two, at least MIN_BUCKET tokens), a moving
  average of the prompt length and of the time per token it measured (`PrefillTimes`), seeded at start by a
  warm-up prefill, and reports the buckets in its heartbeat (`WorkerInfo.prefill_rates`);
- the broker reads the rate for a prompt of N tokens off them (`tokens_per_s`): time per token interpolated
  linearly in N between the measured lengths, extrapolated above them along the slope between the shortest and
  the longest (never falling with N; none if they are under 2× apart), and taken as the shortest's below them.
"""
from __future__ import annotations

from collections.abc import Sequence

from schemas.messages import PrefillRate

MIN_BUCKET = 256  # tokens: shorter prompts share one bucket (their time is mostly fixed costs)
SMOOTHING = 0.3  # weight of the newest prefill in its bucket's averages
MIN_SPAN = 2.0  # extrapolate above the longest length measured only from lengths this far apart (ratio)


class PrefillTimes:
    """A prefill worker's measured prefill times, per length bucket."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[float, float]] = {}  # bucket → (mean tokens, mean seconds per token)

    def observe(self, num_tokens: int, seconds: float) -> bool:
        """Count one prefill; True if it is the first of its length bucket (worth telling the broker at once)."""
        if num_tokens <= 0 or seconds <= 0:
            return False
        bucket = max(MIN_BUCKET, 1 << (num_tokens - 1).bit_length())
        point = (num_tokens, seconds / num_tokens)
        if bucket not in self._buckets:
            self._buckets[bucket] = point
            return True
        self._buckets[bucket] = tuple((1 - SMOOTHING) * old + SMOOTHING * new
                                      for old, new in zip(self._buckets[bucket], point))
        return False

    def report(self) -> list[PrefillRate]:
        """One point per measured bucket, shortest first."""
        return [PrefillRate(round(tokens), round(1 / per_token, 2))
                for _, (tokens, per_token) in sorted(self._buckets.items())]


def tokens_per_s(rates: Sequence[PrefillRate], num_tokens: int) -> float:
    """The prompt rate (tokens/s) to plan a prefill of `num_tokens` with; 0.0 when nothing is measured."""
    points = sorted((r.tokens, 1 / r.tokens_per_s) for r in rates if r.tokens > 0 and r.tokens_per_s > 0)
    if not points:
        return 0.0
    if num_tokens <= points[0][0]:
        return 1 / points[0][1]  # shorter than any measured: per-token time no lower (fixed costs weigh more)
    if num_tokens >= points[-1][0]:
        # the slope over the widest span measured (s per token per token: attention's share grows with N); none
        # where that span is short (one length; 2,000 and 2,050 tokens give a slope made of noise)
        (n0, s0), (n1, s1) = points[0], points[-1]
        slope = max(0.0, (s1 - s0) / (n1 - n0)) if n1 >= MIN_SPAN * n0 else 0.0
        return 1 / (s1 + slope * (num_tokens - n1))
    i = next(i for i in range(1, len(points)) if num_tokens < points[i][0])
    (n0, s0), (n1, s1) = points[i - 1], points[i]
    return 1 / (s0 + (s1 - s0) * (num_tokens - n0) / (n1 - n0))
