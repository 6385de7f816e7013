"""The one thread a process runs its torch work on.

Every model worker (prefill, decode) and the KV-profile service own one `TorchThread`. Handlers on the event
loop `await torch.run(fn, *args)`; torch itself never runs on the event loop, so a long prefill never holds
up heartbeats, NATS replies or data-plane I/O. Jobs run one at a time, in the order they were queued, which
makes `barrier()` a cheap way to wait until everything queued before it (a step that still writes into a
slab, say) has finished.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self, name: str = "torch"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the torch thread, after every job queued before it; its result or its exception."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def barrier(self) -> None:
        """Return once every job queued before this call has finished."""
        await self.run(lambda: None)

    def close(self) -> None:
        """Drop queued jobs; the one running finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
