"""Continuous batching: the decode steps of a worker's running requests go to the model together.

Each request's task asks `await batcher.step(...)` for its next token, as it did when it stepped alone. The
batcher's loop takes every step asked for and runs them as one forward (`DecodeEngine.step_batch`: one
pass through the projections and MLPs for all rows, attention row by row over each request's own slab, with
its own selection and remote reads). Requests join and leave between steps: a new request's first step goes
into the next batch; a finished one simply stops asking.

Between two steps each request sends its token out and does its per-step bookkeeping on the event loop, so
the loop waits up to `gather_s` for the members of the last batch to ask again before it starts the next
one; one that takes longer rides the batch after.

A late read: within a step, every row's remote read for a layer is issued before any row waits, so a layer
waits for its slowest read, not for the sum; a read that fails or times out (`kv_timeout_s`) fails its own
row only (its request fails or recomputes), and the batch carries on. A request whose pushed KV has not
landed yet is not in the batch at all: it joins once its KV is there.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas import Sampling, TokenLogprobs
from shared.compute.decode_engine import DecodeEngine
from shared.compute.grammar import GrammarError, TokenGrammar
from shared.compute.sampling import sample, scored


@dataclass
class _Ask:
    token: int  # the token to feed (completion token index-1)
    sampling: Sampling
    index: int  # the completion index of the token to return
    prompt: Sequence[int]  # what the penalties look at (Sampling's *_penalty), with the completion's first `index`
    completion: Sequence[int]
    grammar: TokenGrammar | None  # the request's, if it has one: masks the row's logits
    future: asyncio.Future[tuple[int, TokenLogprobs | None]]


class StepBatcher:
    def __init__(self, engine: DecodeEngine, in_torch: Callable[..., Awaitable[Any]], max_batch: int,
                 gather_s: float = 0.002):
        self.engine, self.in_torch, self.max_batch, self.gather_s = engine, in_torch, max_batch, gather_s
        self._asks: dict[str, _Ask] = {}  # request id → its next step, in the order asked
        self._members: set[str] = set()  # requests of the last batch that have neither asked again nor left
        self._asked = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_batches = 0
        self.num_rows = 0  # Σ batch sizes: num_rows / num_batches is the mean batch
        self.last_batch = 0
        # request → the torch thread's CPU seconds for its latest step (the batch's, shared evenly by its rows): what
        # the step cost this worker's own core, without the time other threads and processes took from it
        self.step_cpu_s: dict[str, float] = {}
        self._batch_cpu_s = 0.0  # the latest batch's (torch thread; read on the loop once `_step` has returned)

    async def step(self, request_id: str, token: int, sampling: Sampling, index: int, prompt: Sequence[int] = (),
                   completion: Sequence[int] = (), grammar: TokenGrammar | None = None) -> tuple[int, TokenLogprobs | None]:
        """Feed `token` to the request and return its completion token `index` (with its log-probabilities when
        `sampling` asks for them); raises what failed its row. `prompt` and `completion` (tokens so far): for the
        penalties, if `sampling` has any; `grammar`: the request's structured output, advanced over `completion`."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="decode-batcher")
        if request_id in self._asks:
            raise RuntimeError(f"request {request_id} already has a step queued")
        ask = self._asks[request_id] = _Ask(token, sampling, index, prompt, completion, grammar,
                                            asyncio.get_running_loop().create_future())
        self._asked.set()
        try:
            return await ask.future
        except asyncio.CancelledError:  # an abort: drop the step if it has not started (a running one just ends)
            if self._asks.get(request_id) is ask:
                del self._asks[request_id]
            self.leave(request_id)
            raise

    def leave(self, request_id: str) -> None:
        """The request takes no more steps (it ended): the next batch need not wait for it."""
        self._members.discard(request_id)
        self.step_cpu_s.pop(request_id, None)
        self._asked.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._asked.wait()
            self._asked.clear()
            deadline = loop.time() + self.gather_s
            while not self._members <= self._asks.keys() and loop.time() < deadline:
                self._asked.clear()
                try:
                    # NOTE: not wait_for, which on Python 3.11 drops a cancellation (close) that lands as a step is
                    # asked for: the loop went on, and close waited for it forever
                    async with asyncio.timeout_at(deadline):
                        await self._asked.wait()
                except TimeoutError:
                    break
            if not self._asks:
                continue
            batch = list(self._asks.items())[: self.max_batch]
            for request_id, _ in batch:
                del self._asks[request_id]
            self._members = {request_id for request_id, _ in batch}
            self.num_batches += 1
            self.num_rows += len(batch)
            self.last_batch = len(batch)
            try:
                results = await self.in_torch(self._step, [(rid, ask) for rid, ask in batch])
            except Exception as exc:  # noqa: BLE001 (the whole forward failed: every row learns why)
                results = [exc] * len(batch)
            for request_id, _ in batch:
                self.step_cpu_s[request_id] = self._batch_cpu_s / len(batch)
            for (_, ask), result in zip(batch, results):
                if ask.future.done():  # its request was aborted meanwhile
                    continue
                if isinstance(result, Exception):
                    ask.future.set_exception(result)
                else:
                    ask.future.set_result(result)
            if self._asks:
                self._asked.set()

    def _step(self, rows: list[tuple[str, _Ask]]) -> list[tuple[int, TokenLogprobs | None] | Exception]:
        """Torch thread: one batched step, then each row's token sampled from its logits (and scored)."""
        started = time.thread_time()
        out: list[tuple[int, TokenLogprobs | None] | Exception] = []
        for logits, (_, ask) in zip(self.engine.step_batch([(rid, ask.token) for rid, ask in rows]), rows):
            if isinstance(logits, Exception):
                out.append(logits)
            else:
                try:
                    token = sample(logits, ask.sampling, ask.index, ask.prompt, ask.completion, ask.grammar)
                except GrammarError as exc:  # this row's grammar cannot go on: it fails alone
                    out.append(exc)
                    continue
                out.append((token, scored(logits, token, ask.sampling)))
        self._batch_cpu_s = time.thread_time() - started
        return out

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for ask in self._asks.values():
            ask.future.cancel()
        self._asks.clear()

    @property
    def mean_batch(self) -> float:
        return self.num_rows / self.num_batches if self.num_batches else 0.0
