"""Path 3 on the decode node: the rest of a request's KV, read on the background lane while it decodes
(docs/architecture.md, "The three transfer paths"). Two sources of work, both run as event-loop tasks by
services/decode/remote_lifecycle.py: the broker's blocks in profile order (`read_blocks`) and, where path 3 is
ranked, each layer's selection under a wider budget for the latest query (`read_ranked`, queued by
RemoteKv.rank from the torch thread). Neither ever puts a chunk on the wire while an on-demand read of the same
request waits (RemoteKv.wait_on_demand_idle), and one chunk of a request is on the wire at a time.
"""
from __future__ import annotations

import numpy as np
import structlog

from shared.dataplane import Lane
from services.decode.presence import read_chunks
from services.decode.remote import RemoteKv

log = structlog.get_logger()


async def read_blocks(remote: RemoteKv, blocks: list[int]) -> None:
    """Path 3: move these (layer, page) blocks on the background lane, a small read at a time, never while
    an on-demand read of this request is waiting."""
    presence = remote.presence
    # (layer, head, tokens, its segments: K and V rows, or records): marked present only once all have landed
    units = []
    for block in blocks:
        layer, page = divmod(block, presence.num_pages)
        tokens = np.arange(page * presence.page_tokens, min(remote.num_tokens, (page + 1) * presence.page_tokens))
        for h in range(presence.num_kv_heads):
            if not presence.present[layer, h, tokens].all():
                units.append((layer, h, tokens, remote.entry_segments(layer, h, tokens)))
    while units:
        group, size = [], 0
        while units and (not group or size + sum(s.length for s in units[0][3]) <= remote.background_read_bytes):
            group.append(units.pop(0))
            size += sum(s.length for s in group[-1][3])

        def landed(group=group) -> None:  # reads as codes: the records into the rows, inside the transfer
            for layer, h, tokens, _ in group:
                remote.codes_landed(layer, [(h, tokens)])
        async with remote.background_turn:  # one background chunk of this request on the wire at a time
            await remote.wait_on_demand_idle()
            if remote.is_closed:
                return
            for layer in {unit[0] for unit in group}:  # (raises, and the batch is read again after a backoff)
                remote.check_codes_room(layer)
            await remote.read([s for *_, segs in group for s in segs], Lane.BACKGROUND, landed)
        for layer, h, tokens, _ in group:
            presence.mark(layer, h, tokens)
        remote.bytes_background += size


async def read_ranked(remote: RemoteKv) -> None:
    """(event loop task, while the request has remote KV) Read each queued ranking's remote part, oldest first,
    in background-lane chunks, never while an on-demand read of this request is waiting. What is remote is
    decided at read time, so entries an on-demand read brought meanwhile are not read twice. A chunk that fails
    is dropped (these reads only save later on-demand ones); a failed or closed remote view ends the task."""
    chunk_tokens = max(1, remote.background_read_bytes // remote.entry_bytes)  # K and V of one entry, or its record
    while not remote.is_closed:
        if not remote.ranked_queue:
            remote.ranked_queued.clear()
            await remote.ranked_queued.wait()
            continue
        layer = next(iter(remote.ranked_queue))
        ranking = remote.ranked_queue.pop(layer)
        await remote.wait_on_demand_idle()
        _, heads = remote.presence.remote_part(layer, ranking)
        for chunk in read_chunks(heads, chunk_tokens):
            async with remote.background_turn:
                await remote.wait_on_demand_idle()
                if remote.is_closed or remote.failure:
                    return
                try:
                    num_bytes = await remote.read_entries(layer, chunk, Lane.BACKGROUND)
                except Exception as exc:  # noqa: BLE001 (see the docstring)
                    if remote.is_closed or remote.failure:
                        return
                    log.warning("ranked_read_failed", layer=layer, error=str(exc))
                    break
            remote.bytes_background += num_bytes
            remote.bytes_ranked += num_bytes
            remote.num_ranked_reads += 1
