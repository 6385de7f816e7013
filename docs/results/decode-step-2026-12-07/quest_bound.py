"""Quest's selection alone: the page bound as the fast path computed it before 2026-12-07 (elementwise passes over a
(kv, G, pages, d) tensor) against today's two matrix products, interleaved, one thread, both checked against
selectors/reference.py.

    python docs/results/decode-step-2026-12-07/quest_bound.py
"""
import statistics
import time

import torch

from shared.compute.selectors import make_selector, reference
from shared.compute.selectors.base import Geometry

torch.set_num_threads(1)
geometry = Geometry(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16)  # SmolLM2-135M
selector = make_selector("quest", geometry)
gen = torch.Generator().manual_seed(0)


def select_before(state, query: torch.Tensor, k: int) -> torch.Tensor:
    """QuestSelector.select as of 6027b98 (its `_pages` bound by clamp, mul and addcmul_ over (kv, G, pages, d))."""
    g, t, n = geometry, geometry.page_tokens, state.num_tokens
    num_full = n // t
    tail_tokens = n - num_full * t
    num_pages = min(num_full, max(0 if tail_tokens else 1, (k - tail_tokens) // t))
    tail = torch.arange(num_full * t, n).expand(g.num_kv_heads, -1)
    lo, hi = state.page_min.data[:, None, :num_full], state.page_max.data[:, None, :num_full]
    q = query.float().view(g.num_kv_heads, g.group, 1, -1)
    bound = (q.clamp(max=0) * lo).addcmul_(q.clamp(min=0), hi).sum(-1)
    pages = torch.sort(torch.topk(bound.sum(1), num_pages, dim=-1, sorted=False).indices, dim=-1).values
    tokens = (pages[..., None] * t + torch.arange(t)).flatten(1)
    return torch.cat([tokens, tail], dim=1)


for n in (2048, 8192):
    state = selector.new_state(5)
    selector.extend(5, state, torch.randn(3, n, 64, generator=gen))
    query, k = torch.randn(9, 64, generator=gen), n // 10
    runs = {"before": lambda: select_before(state, query, k), "now": lambda: selector.select(5, state, query, k)}
    assert torch.equal(runs["before"](), reference.select(selector, 5, state, query, k))
    assert torch.equal(runs["now"](), reference.select(selector, 5, state, query, k))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(40):
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(30):  # one decode step's selections: one per layer
                run()
            times[name].append((time.perf_counter() - started) * 1e3)
    print(f"{n} tokens, 10%: " + ", ".join(f"{name} {statistics.median(t):.2f} ms" for name, t in times.items())
          + " per 30 selections (median of 40)")
