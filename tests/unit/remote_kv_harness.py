"""The harness of the remote-KV tests (test_remote_kv.py, test_remote_kv_codes.py): a tiny 8-layer model, its
all-local tokens, and a decode over a partly remote cache on the in-process data plane."""
from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

import torch

from schemas import NO_FLOOR, KvSource, Sampling, entry_region_bytes
from shared.compute.decode_engine import DecodeEngine
from services.decode.remote_lifecycle import read_blocks, read_ranked
from services.decode.direct_reads import DirectReads
from services.decode.remote import RemoteKv
from shared.compute.prefill_engine import PrefillEngine, QueryPush
from shared.compute.sampling import sample
from shared.compute.selectors.metadata import MetadataLayout
from shared.dataplane import Grant, make_dataplane
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 6
STEPS = 12


@pytest.fixture(scope="module")
def runner(tiny8_model_path) -> ModelRunner:
    """A tiny 8-layer random Llama: six selective layers."""
    return ModelRunner(tiny8_model_path)


def colocated_tokens(runner: ModelRunner, ids: list[int], selector: str, budget: float) -> list[int]:
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), floor=NO_FLOOR)
    tokens = [engine.prefill_local("r", ids, Sampling())]
    engine.use_selection("r", selector, budget)
    for i in range(1, STEPS):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    return tokens


async def remote_tokens(runner: ModelRunner, ids: list[int], selector: str, budget: float, pushed_layers: int,
                        parallel: bool, background: bool, read_delay_s: float = 0.0,
                        gather: bool = True, calls: dict[str, int] | None = None, speculative: bool = True,
                        land_every_s: float = 0.0, ranked: bool = False, kv_bits: int = 0, read_codes: bool = True,
                        kv_dtype: str = "", slabs: dict[str, torch.Tensor] | None = None,
                        forced: list[int] | None = None, logits: list[torch.Tensor] | None = None,
                        stalls: bool = True, direct: bool = False, break_direct_after: int = 0):
    """Prefill on one store, push metadata and the first `pushed_layers` layers to another, decode there with
    the rest read over the in-process data plane (`calls`, if given, counts its `read` and `read_gather` calls).
    The decode slab starts as NaN, so any entry used before it arrived would poison the output. `land_every_s`:
    no push barrier, the push lands a layer every this many seconds while step 1 runs. `ranked`: path 3 by the
    latest query runs while decoding (`read_ranked`). `kv_bits` (smartgen's low-bit KV): the pushed layers travel
    as records of codes, dequantized on the decode side as they land, and with `read_codes` the reads move records
    too (KvSource.codes_bits; without it they move exact rows). `kv_dtype`: the stores' ("" = the model's).
    `slabs`, if given, gets both sides' prompt rows at the end ("src", "dst": (L, K|V, H, N, d)). `forced`: feed
    these tokens (teacher forcing) instead of the ones sampled; `logits`, if given, gets each step's. `stalls`
    False: the request ablates "stall" (services/decode/read_behind.py). `direct`: over TCP, path 2's reads on the
    torch thread's own link (services/decode/direct_reads.py), which `break_direct_after` steps breaks."""
    layout = runner.kv_layout(16, kv_dtype)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 7)  # different offsets on the two sides
    n = len(ids)
    pages = -(-n // 16)
    pushed = np.zeros((layout.num_layers, pages), dtype=bool)
    pushed[:pushed_layers] = True
    prefill = PrefillEngine(runner, src)
    meta_bytes = MetadataLayout(prefill.selector(selector), layout.num_layers, n, query_bitmap=bool(kv_bits)).nbytes
    region = entry_region_bytes(layout, n, kv_bits)  # the push's codes region (kv_bits), as the decode node reserves
    src_slab = src.allocate("r", n, meta_bytes + region * (2 if kv_bits and read_codes else 1))
    dst_slab = dst.allocate("r", n + STEPS, meta_bytes + region)
    dst.view(dst_slab).fill_(float("nan"))
    query_push = QueryPush(0, pushed, 16, NO_FLOOR) if kv_bits else None  # no entries picked by query: blocks only
    meta, encode = prefill.metadata_encoder(src_slab, selector, n, query_push, kv_bits,
                                            meta_bytes + region if kv_bits and read_codes else -1)
    first = prefill.run(src_slab, ids, Sampling(), lambda layer: None, encode)

    def push_layer(layer: int) -> None:  # its metadata, and its rows (or their records) if the plan pushes them
        if layer >= 2:
            at, length = meta.layer_range(layer)
            dst.aux(dst_slab)[at: at + length] = src.aux(src_slab)[at: at + length]
        if layer < pushed_layers and query_push is not None and query_push.codes is not None:
            at, length = query_push.codes.layer_range(layer, query_push.num_records[layer])
            dst.aux(dst_slab)[at: at + length] = src.aux(src_slab)[at: at + length]
        elif layer < pushed_layers:
            dst.view(dst_slab)[layer, :, :, :n] = src.view(src_slab)[layer, :, :, :n]
    if not land_every_s:
        for layer in range(layout.num_layers):
            push_layer(layer)
    a, b = (make_dataplane("tcp"), make_dataplane("tcp")) if direct else (make_dataplane("inproc"), make_dataplane("inproc"))
    a.register_region(src.region)
    b.register_region(dst.region)
    await a.start()
    await b.start()
    if read_delay_s:  # a slow link: every read takes this long before it starts
        read = b.read

        async def slow_read(*args, **kwargs):
            await asyncio.sleep(read_delay_s)
            return await read(*args, **kwargs)
        b.read = slow_read
    if calls is not None:
        for name in ("read", "read_gather"):
            def counted(*args, _method=getattr(b, name), _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _method(*args, **kwargs)
            setattr(b, name, counted)
    ticket = secrets.randbits(63)
    engine = DecodeEngine(runner, dst, floor=NO_FLOOR)
    if query_push is not None and query_push.read_codes is not None:  # reads as codes: only the read codes readable
        codes_at = src.aux_offset(src_slab) + query_push.read_codes.offset
        a.grant(Grant(ticket, [(codes_at, codes_at + query_push.read_codes.nbytes)]))
        source = KvSource("p", a.address, ticket, src.offset(src_slab), src_slab.capacity, 30.0, codes_at, kv_bits)
    else:
        a.grant(Grant(ticket, [(off, off + ln) for layer in range(layout.num_layers)
                               for off, ln in src.rows(src_slab, layer, 0, n)]))
        source = KvSource("p", a.address, ticket, src.offset(src_slab), src_slab.capacity, 30.0)
    codes_at = dst.aux_offset(dst_slab) + engine.entry_codes(selector, n, kv_bits).offset if source.codes_bits else -1
    direct_reads = None
    if direct:
        direct_reads = DirectReads(b, dst.region, True, 30.0)
        direct_reads.open(a.address)
        while a.address not in direct_reads.readers:
            await asyncio.sleep(0.005)
    remote = RemoteKv(b, asyncio.get_running_loop(), source, layout, dst.offset(dst_slab), dst_slab.capacity, n,
                      pushed, parallel, gather_reads=gather, speculative=speculative, ranked=ranked, stalls=stalls,
                      codes_at=codes_at, region=dst.region, direct=direct_reads)
    loop = asyncio.get_running_loop()
    engine.load_from_store("r", dst_slab, n)
    landing = None
    load_codes = engine.pushed_codes_loader(dst_slab, selector, n, kv_bits, pushed) if kv_bits else None
    if not land_every_s and load_codes is not None:  # the push has landed: its records into the rows
        for layer in range(layout.num_layers):
            load_codes(layer, None)
    if land_every_s:
        remote.await_pushes(None if load_codes is None else lambda layer: load_codes(layer, None))

        async def land() -> None:
            for layer in range(layout.num_layers):
                await asyncio.sleep(land_every_s)
                push_layer(layer)
                remote.push_landed(layer, None)
        landing = asyncio.create_task(land())
    engine.use_selection("r", selector, budget, slab=dst_slab, remote=remote, query_bitmap=bool(kv_bits),
                         lazy=bool(land_every_s))
    ranked_reads = asyncio.create_task(read_ranked(remote)) if ranked else None
    tokens = [first]
    for i in range(1, STEPS):
        fed = forced[i - 1] if forced else tokens[-1]
        step_logits = await loop.run_in_executor(None, engine.step_logits, "r", fed)  # a torch thread
        tokens.append(sample(step_logits, Sampling(), i))
        if logits is not None:
            logits.append(step_logits)
        if landing is not None:  # step 1 waited for every layer's push
            assert landing.done()
            await landing
            landing = None
        if direct_reads is not None and i == break_direct_after:
            direct_reads.drop(a.address)  # as when the link to the peer is lost: later reads go via the loop
        if background and i == 2:
            await read_blocks(remote, list(range(layout.num_layers * pages)))
        if ranked_reads is not None:  # let the reads queued during the step go out before the next one
            while remote.ranked_queue or (remote.background_turn.locked()):
                await asyncio.sleep(0.001)
    if ranked_reads is not None:
        ranked_reads.cancel()
    await remote.close()
    if direct_reads is not None:
        assert not direct_reads.pending  # no direct read outlives its step
        await direct_reads.close()
    if direct:
        await a.close()
        await b.close()
    if slabs is not None:
        slabs["src"], slabs["dst"] = src.view(src_slab)[:, :, :, :n].clone(), dst.view(dst_slab)[:, :, :, :n].clone()
    return tokens, remote

