"""Step 1 of a request's life on a decode worker (service.py): `open` admits it, reserves its slab and grants the
push ticket. Also the admission every request passes (colocated ones at `generate`): a slot, room in the KV store,
and a reservation that expires when no `generate` claims it; and the checks `open` makes (every reason it refuses a
request as malformed). Mixed into DecodeService, whose state it reads and sets.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from schemas import ErrorCode, ModeName, KvHandle, OpenKv, mode_of, modes_where
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore, OutOfPages, Slab
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import PreparationMissing
from shared.dataplane import Grant
from shared.runtime.rpc import RequestRefused
from services.decode.request import DecodeRequest, Phase

if TYPE_CHECKING:
    from services.decode.service import DecodeService

log = structlog.get_logger()


class Admission:
    async def open(self: DecodeService, req: OpenKv) -> KvHandle:
        assert self.store and self.dataplane and self.runner
        if problem := open_problem(req, self.runner):
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)
        try:
            aux_bytes = await aux_to_reserve(self.engine, self.in_torch, req)
        except ValueError as exc:
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
        if req.request_id in self.aborted:  # NOTE: the abort overtook this open while it sized the aux area
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        self._check_fits(req.num_tokens, req.max_tokens, aux_bytes)
        self._admit(req.request_id)
        slab = self._allocate(req.request_id, req.num_tokens + req.max_tokens, aux_bytes)
        state = self.active[req.request_id] = DecodeRequest(req.request_id, mode_of(req.transfer_mode), req.num_tokens, slab)
        if self.dataplane.faults.open_delay_s:  # fault injection (tests): reserved, not answered yet
            await asyncio.sleep(self.dataplane.faults.open_delay_s)
        if req.transfer_mode == ModeName.FULL and req.token_ids and self.engine.prefix_cache is not None:
            # NOTE: registered first, so an abort meanwhile frees the slab (after the copy: the torch thread is FIFO)
            try:
                state.cached_tokens = await self.in_torch(self.engine.reuse_prefix, slab, req.token_ids)
            except BaseException:
                await asyncio.shield(self._release(state))
                raise
        if self.active.get(req.request_id) is not state:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        rows = [r for layer in range(self.store.layout.num_layers)
                for r in self.store.rows(slab, layer, state.cached_tokens, req.num_tokens)]
        aux_at = self.store.aux_offset(slab)
        ranges = [(off, off + n) for off, n in rows] + ([(aux_at, aux_at + aux_bytes)] if aux_bytes else [])
        state.grant = Grant(secrets.randbits(63), ranges, state.on_landed)
        self.dataplane.grant(state.grant)
        state.expiry = asyncio.get_running_loop().call_later(
            self.config.open_timeout_s, lambda: asyncio.ensure_future(self._expire(req.request_id)))
        return KvHandle(req.request_id, self.worker_id, self.dataplane.address, state.grant.ticket, self.store.layout,
                        req.num_tokens, self.store.offset(slab), slab.capacity, aux_at, aux_bytes, self.config.floor,
                        state.cached_tokens)

    def _admit(self: DecodeService, request_id: str) -> None:
        if self.draining:
            raise RequestRefused(ErrorCode.OVERLOADED, "draining: this decode worker is stopping; ask another")
        if request_id in self.active:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"request {request_id} is already here")
        if len(self.active) >= self.config.max_active_requests:
            raise RequestRefused(ErrorCode.AT_CAPACITY, f"at capacity: {len(self.active)} requests in progress")

    def _check_fits(self: DecodeService, num_tokens: int, max_tokens: int, aux_bytes: int) -> None:
        if problem := fits_problem(self.store, num_tokens, max_tokens, aux_bytes):
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)

    def _allocate(self: DecodeService, request_id: str, capacity: int, aux_bytes: int) -> Slab:
        """A slab for the request, or `overloaded` while the store is full."""
        assert self.store
        try:
            return self.store.allocate(request_id, capacity, aux_bytes)
        except OutOfPages as exc:
            raise RequestRefused(ErrorCode.OVERLOADED, str(exc)) from None

    async def _expire(self: DecodeService, request_id: str) -> None:
        if (state := self.active.get(request_id)) is not None and state.phase is Phase.RESERVED:
            log.warning("reservation_expired", request_id=request_id)
            await self._release(state)


# --- the checks `open` and admission make ---------------------------------------------------------
def open_problem(req: OpenKv, runner: ModelRunner) -> str:
    """Why `open` cannot reserve for `req` ("" if it can): a 400."""
    if req.transfer_mode not in modes_where(is_disaggregated=True):
        return f"open is for disaggregated transfer modes, not {req.transfer_mode!r}"
    if not 0 < req.num_tokens or req.max_tokens < 1 or req.num_tokens + req.max_tokens > runner.max_positions:
        return f"{req.num_tokens} prompt + {req.max_tokens} completion tokens do not fit 1..{runner.max_positions}"
    if req.token_ids and len(req.token_ids) != req.num_tokens:
        return f"token_ids must be the prompt's {req.num_tokens} token ids, not {len(req.token_ids)}"
    if req.token_ids and (problem := runner.token_problem(req.token_ids)):
        return f"token_ids: {problem}"
    return ""


async def aux_to_reserve(engine: DecodeEngine, in_torch: Callable[..., Awaitable[Any]], req: OpenKv) -> int:
    """The aux area an `open` reserves: selector metadata (selective modes and auto) or low-bit codes.
    ValueError saying why it cannot (a 400)."""
    mode = mode_of(req.transfer_mode)
    if mode.aux is Aux.NONE:
        return 0
    if mode.aux is Aux.METADATA and not req.selector:
        raise ValueError(f"transfer_mode {req.transfer_mode!r} needs a selector")
    try:
        args = (mode.aux, req.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
        if engine.has_selector(req.selector):  # sizes only: no need to queue behind the model's steps
            aux_bytes = engine.aux_bytes(*args)
        else:
            aux_bytes = await in_torch(engine.aux_bytes, *args)  # loads the selector's preparation once
        if req.kv_bits and Aux.CODES in (mode_of(m).aux for m in mode.resolves_to):  # auto may choose quantized
            aux_bytes = max(aux_bytes, engine.aux_bytes(Aux.CODES, req.num_tokens, "", req.kv_bits))
        return aux_bytes
    except PreparationMissing as exc:
        raise ValueError(str(exc)) from None


def fits_problem(store: KvStore, num_tokens: int, max_tokens: int, aux_bytes: int) -> str:
    """Why a request of `num_tokens` prompt and `max_tokens` completion tokens can never run on this worker's whole
    store ("" when it can): a 400, not a 429."""
    if store.pages_needed(num_tokens + max_tokens, aux_bytes) <= store.num_pages_total:
        return ""
    return (f"{num_tokens} + {max_tokens} tokens of KV exceed this worker's whole store "
            f"({store.num_pages_total * store.layout.page_tokens} tokens): ask for fewer tokens or raise kv_cache_mb")
