"""Step 4 of a request's life on a prefill worker (service.py), partial and smartgen: after the prefill its slab
stays, readable by the decode node under a fresh ticket (KvSource) and held by a lease from when the last push has
left. The decode node extends the lease (`keep`) and ends it (`release`: every entry is local, or the request ended);
a lease that runs out frees the slab and tells the decode node. Mixed into PrefillService.
"""
from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING

import structlog

from schemas import Ack, KeepLease, KvSource, Release
from shared.dataplane import Grant
from services.prefill.pushes import Transfer

if TYPE_CHECKING:
    from services.prefill.service import PrefillService

log = structlog.get_logger()


class Lease:
    def _keep_for_reads(self: PrefillService, transfer: Transfer) -> KvSource:
        """Selective modes: the slab stays under a lease, readable with a fresh ticket over its prompt rows, or,
        where reads move codes (smartgen with kv_bits), over its read-codes region only: nothing reads exact rows."""
        assert self.store and self.dataplane
        layers, n = self.store.layout.num_layers, transfer.handle.num_tokens
        codes = transfer.query_push.read_codes if transfer.query_push is not None else None
        if codes is not None:
            codes_offset, codes_bits = self.store.aux_offset(transfer.slab) + codes.offset, codes.bits
            ranges = [(codes_offset, codes_offset + codes.nbytes)]
        else:
            codes_offset = codes_bits = 0
            ranges = [(off, off + length) for layer in range(layers) for off, length in self.store.rows(transfer.slab, layer, 0, n)]
        transfer.read_grant = Grant(secrets.randbits(63), ranges)
        self.dataplane.grant(transfer.read_grant)  # NOTE: the lease starts in _await_pushes (life cycle, 4)
        return KvSource(self.worker_id, self.dataplane.address, transfer.read_grant.ticket,
                        self.store.offset(transfer.slab), transfer.slab.capacity, self.config.lease_s, codes_offset,
                        codes_bits)

    async def keep(self: PrefillService, req: KeepLease) -> None:
        if (transfer := self.active.get(req.request_id)) is not None and transfer.lease is not None:
            self._arm_lease(transfer)

    def _arm_lease(self: PrefillService, transfer: Transfer) -> None:
        if transfer.lease is not None:
            transfer.lease.cancel()
        rid = transfer.handle.request_id
        transfer.lease = asyncio.get_running_loop().call_later(
            self.config.lease_s, lambda: asyncio.ensure_future(self._expire(rid, transfer)))

    async def _expire(self: PrefillService, request_id: str, transfer: Transfer) -> None:
        if self.active.get(request_id) is transfer:
            log.warning("lease_expired", request_id=request_id, lease_s=self.config.lease_s)
            self.leases_expired.inc()
            await self._report_failure(transfer.handle, f"the prefill's lease expired ({self.config.lease_s:g} s)")
            await self._finish(request_id, cancel=True)

    async def release(self: PrefillService, req: Release) -> Ack:
        transfer = self.active.get(req.request_id)
        if transfer is not None:
            log.info("kv_released", request_id=req.request_id, reason=req.reason)
            # NOTE: freed in its own task: waiting out a read still leaving must not hold up the next release
            # (nats runs an endpoint's handlers one after another)
            self._background(self._finish(req.request_id, cancel=True))
        return Ack()
