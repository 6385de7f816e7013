"""Can two Python threads run a batched step's per-row selections faster than one? 8 rows × 28 layers of Quest
selections at 4K (random keys and queries, the default floor), on one thread, then with half the rows of each layer
on a second thread (both at one torch thread each: torch ops release the GIL inside).

    OMP_WAIT_POLICY=PASSIVE python docs/results/decode-batch-2026-12-07/split_threads.py
"""
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from schemas import DEFAULT_FLOOR
from shared.compute.floor import select_with_floor
from shared.compute.selectors.base import Geometry
from shared.compute.selectors.quest import QuestSelector

torch.manual_seed(0)
torch.set_num_threads(1)
selector = QuestSelector(Geometry(30, 9, 3, 64))
rows, n, layers = 8, 4096, 28
states = []
for _ in range(rows):
    keys = torch.randn(3, n, 64)
    per_layer = [selector.new_state(layer) for layer in range(layers)]
    for layer, state in enumerate(per_layer):
        selector.extend(layer, state, keys)
    states.append(per_layer)
queries = [torch.randn(9, 64) for _ in range(rows)]
k = DEFAULT_FLOOR.tokens(0.1, n)


def select(b: int, layer: int) -> torch.Tensor:
    return select_with_floor(selector, layer, states[b][layer], queries[b], k, n, DEFAULT_FLOOR)


def helper_init() -> None:
    torch.set_num_threads(1)


pool = ThreadPoolExecutor(1, initializer=helper_init)


def one_thread() -> None:
    for layer in range(layers):
        for b in range(rows):
            select(b, layer)


def two_threads() -> None:
    def second_half(layer: int) -> None:
        with torch.inference_mode():
            for b in range(rows // 2, rows):
                select(b, layer)

    for layer in range(layers):
        done = pool.submit(second_half, layer)
        for b in range(rows // 2):
            select(b, layer)
        done.result()


with torch.inference_mode():
    times = {"one thread": [], "two threads": []}
    for _ in range(16):
        for name, run in (("one thread", one_thread), ("two threads", two_threads)):
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
print({name: f"{statistics.median(t[1:]) * 1e3:.1f} ms" for name, t in times.items()},
      f"for {rows} rows × {layers} layers of Quest selections at {n} tokens")
