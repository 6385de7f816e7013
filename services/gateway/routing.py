"""KV-aware routing: which decode worker holds the longest cached prefix of a prompt, as this gateway remembers it.

After a full-mode request finishes, the gateway records the hash-chain keys (schemas.page_keys) of the tokens whose
KV that request left in its decode worker's prefix cache: its prompt's full pages. A new full-mode request goes to
the worker holding the most of its pages, unless that worker runs more than
`slack` requests beyond the least loaded one (then, and on no hit or a tie, the least loaded wins:
shared/runtime/registry.py `pick`).

Why the gateway's own memory and not a summary in the decode workers' heartbeats: it needs no new message, and
a pool of 22K tokens is 1,400 keys of 32 bytes, too many to send every second. It is an estimate: the worker may have
evicted the pages, and another gateway's requests are not in it. A wrong guess costs nothing but the hit: the decode
worker looks its own pool up at `open` and the prefill pushes whatever it lacks.

The gateway keeps a second one for the prefill workers (recorded after each prefill by a worker whose prefix cache
is on, every mode): every disaggregated request goes to the prefill worker holding the most of its prompt, and the
broker sizes the plan's push with that hit (OpenPlan.prefill_cached_tokens: the prefill computes only the rest,
services/broker/planner.py `prefill_seconds`). A wrong guess there costs a push sized for a shorter or longer
prefill than the one that runs.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from schemas import page_keys

MAX_PAGES = 65_536  # page keys remembered, over every decode worker (LRU): ~1M tokens of 16-token pages, ~10 MB


class PrefixRoutes:
    def __init__(self, slack: int, max_pages: int = MAX_PAGES):
        if slack < 0 or max_pages <= 0:
            raise ValueError("slack must be ≥ 0 and max_pages positive")
        self.slack, self.max_pages = slack, max_pages
        self.page_tokens = 0  # the decode workers' page size, learned from their KvHandles (0: nothing recorded yet)
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # page key → decode workers; least recent first

    def record(self, worker_id: str, token_ids: Sequence[int], page_tokens: int) -> None:
        """`worker_id`'s prefix cache now holds the KV of `token_ids` (a finished request's), in pages of `page_tokens`."""
        self.page_tokens = page_tokens
        for key in page_keys(token_ids, page_tokens):
            self._holders.setdefault(key, set()).add(worker_id)
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_pages:
            self._holders.popitem(last=False)

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per decode worker with a hit: how many of the first `token_ids` it holds, in whole pages."""
        if not self.page_tokens:
            return {}
        hits: dict[str, int] = {}
        holding: set[str] | None = None
        for index, key in enumerate(page_keys(token_ids, self.page_tokens)):
            holding = set(self._holders.get(key, ())) if holding is None else holding & self._holders.get(key, set())
            if not holding:
                break
            hits.update(dict.fromkeys(holding, (index + 1) * self.page_tokens))
        return hits
