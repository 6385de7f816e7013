"""Selective decoding over a partly remote cache (paths 2 and 3) with the network reduced to the in-process
data plane: the same tokens as with every entry local, reads only of what is missing, and presence that
ends all local."""
from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

import torch

from schemas import NO_FLOOR, KvSource, Sampling, entry_record_bytes, entry_region_bytes
from shared.compute.decode_engine import DecodeEngine
from shared.compute.entry_codes import EntryCodes, every_entry
from services.decode.background import read_blocks, read_ranked
from services.decode.remote import RemoteKv, RemoteReadError
from shared.compute.prefill_engine import PrefillEngine, QueryPush
from shared.compute.sampling import sample
from shared.compute.selectors.metadata import MetadataLayout
from shared.dataplane import Grant, make_dataplane
from shared.compute.kvstore import KvStore, layout_for
from shared.compute.modeling import ModelRunner
from tools.tiny_model import make_tiny_model
from tests.reference import prompt_ids

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 6
STEPS = 12


@pytest.fixture(scope="module")
def runner(tmp_path_factory, real_model_path) -> ModelRunner:
    """A tiny 8-layer random Llama: six selective layers."""
    return ModelRunner(make_tiny_model(tmp_path_factory.mktemp("tiny8"), real_model_path, num_layers=8))


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
                        forced: list[int] | None = None, logits: list[torch.Tensor] | None = None):
    """Prefill on one store, push metadata and the first `pushed_layers` layers to another, decode there with
    the rest read over the in-process data plane (`calls`, if given, counts its `read` and `read_gather` calls).
    The decode slab starts as NaN, so any entry used before it arrived would poison the output. `land_every_s`:
    no push barrier, the push lands a layer every this many seconds while step 1 runs. `ranked`: path 3 by the
    latest query runs while decoding (`read_ranked`). `kv_bits` (smartgen's low-bit KV): the pushed layers travel
    as records of codes, dequantized on the decode side as they land, and with `read_codes` the reads move records
    too (KvSource.codes_bits; without it they move exact rows). `kv_dtype`: the stores' ("" = the model's).
    `slabs`, if given, gets both sides' prompt rows at the end ("src", "dst": (L, K|V, H, N, d)). `forced`: feed
    these tokens (teacher forcing) instead of the ones sampled; `logits`, if given, gets each step's."""
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
    a, b = make_dataplane("inproc"), make_dataplane("inproc")
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
    remote = RemoteKv(b, asyncio.get_running_loop(), source, layout, dst.offset(dst_slab), dst_slab.capacity, n,
                      pushed, parallel, gather_reads=gather, speculative=speculative, ranked=ranked,
                      codes_at=codes_at, region=dst.region)
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
        if background and i == 2:
            await read_blocks(remote, list(range(layout.num_layers * pages)))
        if ranked_reads is not None:  # let the reads queued during the step go out before the next one
            while remote.ranked_queue or (remote.background_turn.locked()):
                await asyncio.sleep(0.001)
    if ranked_reads is not None:
        ranked_reads.cancel()
    await remote.close()
    if slabs is not None:
        slabs["src"], slabs["dst"] = src.view(src_slab)[:, :, :, :n].clone(), dst.view(dst_slab)[:, :, :, :n].clone()
    return tokens, remote


@pytest.mark.parametrize("selector", ["quest", "oracle", "hata_untrained"])  # the prepared ones' path is the same
@pytest.mark.parametrize("parallel", [True, False])
async def test_remote_reads_give_the_all_local_tokens(runner, selector, parallel):
    """With only layers 0–1 pushed, decoding that reads the rest on demand gives exactly the tokens of the
    same selector with every entry local."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 2, parallel, background=False)
    assert tokens == colocated_tokens(runner, ids, selector, 0.1)
    assert remote.bytes_on_demand > 0 and remote.num_missing > 0  # it read some, not all
    assert remote.step_local_share[0] < remote.step_local_share[-1] <= 1.0  # what was read stays local


@pytest.mark.parametrize("selector", ["quest", "oracle"])
async def test_step_one_runs_while_the_push_lands_a_layer_at_a_time(runner, selector):
    """No global push barrier: the metadata and the first four layers land one layer every 20 ms while step 1
    already runs (a NaN slab: a layer attending before its bytes are in would poison the output). Each layer
    waits for its own push only, and the tokens are those of all entries local."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 4, True, background=False, land_every_s=0.02)
    assert tokens == colocated_tokens(runner, ids, selector, 0.1)
    assert remote.landing_wait_s > 0.02 and remote.step_wait[0] >= remote.landing_wait_s


async def test_a_layer_waiting_for_its_push_stops_when_the_request_is_released(runner):
    """A layer blocked in `ready` (its push has not landed) raises at once when the remote view is closed, or
    the push fails, instead of holding the torch thread until the read timeout."""
    layout = runner.kv_layout(16)
    plane = make_dataplane("inproc")
    for end in ("close", "fail"):
        remote = RemoteKv(plane, asyncio.get_running_loop(), KvSource("p", "x", 1, 0, 64, 30.0), layout, 0, 64, 32,
                          np.zeros((layout.num_layers, 2), dtype=bool), read_timeout_s=30.0)
        remote.await_pushes(None)
        waiting = asyncio.get_running_loop().run_in_executor(None, remote.ready, 3)
        await asyncio.sleep(0.05)
        assert not waiting.done() and not remote.is_all_local
        if end == "close":
            await remote.close()
        else:
            remote.fail("the link dropped")
        with pytest.raises(RemoteReadError, match="released" if end == "close" else "dropped"):
            await asyncio.wait_for(waiting, 2)


@pytest.mark.parametrize("selector", ["oracle", "hata_untrained"])
async def test_token_level_reads_go_as_one_gather_per_layer(runner, selector):
    """Token-level selections (oracle, HATA: runs of a token or two) are read as one gather per layer and step,
    never as segments. Gathers and segments read the same entries: the same tokens, bytes and presence."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    by_gather, by_segments = {}, {}
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, calls=by_gather,
                                         speculative=False)
    plain_tokens, plain = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, gather=False,
                                              calls=by_segments, speculative=False)
    assert tokens == plain_tokens
    assert remote.bytes_on_demand == plain.bytes_on_demand > 0 and (remote.present == plain.present).all()
    assert "read_gather" not in by_segments and "read" not in by_gather
    selective_layers, steps = remote.present.shape[0] - 2, STEPS - 1
    assert 0 < by_gather["read_gather"] == by_segments["read"] <= selective_layers * steps


@pytest.mark.parametrize("selector", ["quest", "oracle"])
async def test_speculation_reads_the_next_layer_ahead_and_never_changes_tokens(runner, selector):
    """While layer i runs, layer i+1's selection is predicted from layer i's input and its remote part read
    (`speculate`): the tokens stay those of every entry local, layers then find more of what they select already
    read, and without speculation nothing is read ahead. (A random tiny model predicts its next layer poorly, so
    a layer usually still reads its misses; on SmolLM2 see docs/results.)"""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False)
    plain_tokens, plain = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, speculative=False)
    assert tokens == plain_tokens == colocated_tokens(runner, ids, selector, 0.1)
    assert remote.num_speculative_reads > 0 and plain.num_speculative_reads == 0
    assert remote.num_read_remote < plain.num_read_remote and remote.num_fetch_reads <= plain.num_fetch_reads


@pytest.mark.parametrize("selector", ["quest", "oracle"])
async def test_ranked_reads_bring_what_a_wider_selection_adds_and_never_change_tokens(runner, selector):
    """Path 3 by the latest query: a layer that read this step ranks again under twice its budget, and what that
    adds is read on the background lane before the next step. The tokens stay those of every entry local; later
    steps find more of their selection local than without it; nothing is ranked when it is off."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, ranked=True)
    plain_tokens, plain = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False)
    assert tokens == plain_tokens == colocated_tokens(runner, ids, selector, 0.1)
    assert remote.num_ranked_reads > 0 and remote.bytes_ranked == remote.bytes_background > 0
    assert plain.num_ranked_reads == 0 and plain.bytes_background == 0
    assert remote.num_read_remote < plain.num_read_remote
    assert remote.bytes_on_demand < plain.bytes_on_demand


async def test_background_makes_everything_local(runner):
    """Reading every block in the background ends with no entry missing; tokens are unchanged."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=True)
    assert tokens == colocated_tokens(runner, ids, "quest", 0.1)
    assert remote.is_all_local and remote.bytes_background > 0
    assert remote.step_local_share[-1] == 1.0 and remote.local_blocks().all()


async def test_a_closed_remote_refuses_new_reads(runner):
    """After close (the lease is released), a fetch is an error, not a read into freed pages."""
    ids = prompt_ids(runner.path, PROMPT)[:100]
    _, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False)
    with pytest.raises(RemoteReadError):
        remote.fetch(3, None)


def dequantized(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference for an entry that travelled as codes: each (layer, KV head, token) of `rows` (L, K|V, H, N, d)
    quantized to its record and dequantized again by torch (shared/compute/entry_codes.py), in `rows`' dtype."""
    num_layers, _, heads, n, d = rows.shape
    codes = EntryCodes(num_layers, heads, d, n, bits, offset=0)
    aux, out = torch.zeros(codes.nbytes, dtype=torch.uint8), torch.empty_like(rows)
    for layer in range(num_layers):
        codes.encode(aux, layer, rows[layer, 0].float(), rows[layer, 1].float(), every_entry(heads, n))
        codes.decode(aux, layer, every_entry(heads, n), out[layer, 0], out[layer, 1])
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
async def test_with_kv_bits_on_demand_reads_move_records_and_land_as_their_dequantized_values(runner, bits, kv_dtype):
    """smartgen with kv_bits: the prefill serves every entry as a record of codes (K 8-bit, V `bits`), on-demand
    reads (fetch and speculation) move records, not rows — the bytes read are the records' — and each entry read
    lands in the decode slab as torch's quantize→dequantize of its exact value, bit for bit (NumPy decodes it on the
    event loop, in the slab's dtype), like the pushed ones; nothing else of the slab is touched."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    codes_slabs, exact_slabs, calls = {}, {}, {}
    _, remote = await remote_tokens(runner, ids, "oracle", 0.1, 2, True, background=False, kv_bits=bits,
                                    kv_dtype=kv_dtype, slabs=codes_slabs, calls=calls)
    _, exact = await remote_tokens(runner, ids, "oracle", 0.1, 2, True, background=False, kv_bits=bits,
                                   read_codes=False, kv_dtype=kv_dtype, slabs=exact_slabs)
    assert remote.codes is not None and exact.codes is None and remote.num_speculative_reads > 0
    record, row = entry_record_bytes(16, bits), exact.entry_bytes  # the tiny model: 16 channels per head
    assert remote.entry_bytes == record < row  # 40 or 32 bytes against 64 (bf16) or 128 (fp32)
    read, exact_read = remote.present.copy(), exact.present.copy()  # (L, H, N): layers 0–1 pushed, the rest read
    read[:2] = exact_read[:2] = False
    assert remote.bytes_on_demand == int(read.sum()) * record > 0 and calls.get("read_gather", 0) > 0
    assert exact.bytes_on_demand == int(exact_read.sum()) * row
    reference = dequantized(codes_slabs["src"], bits)
    local = torch.from_numpy(remote.present)[:, None, :, :, None].expand_as(reference)
    assert torch.equal(codes_slabs["dst"][local], reference[local])  # pushed and read: each its codes' value
    assert codes_slabs["dst"][~local].isnan().all()  # nothing else was touched
    exact_read = torch.from_numpy(exact_read)[:, None, :, :, None].expand_as(reference)
    assert torch.equal(exact_slabs["dst"][exact_read], exact_slabs["src"][exact_read])  # exact reads: exact values


@pytest.mark.parametrize("selector", ["quest", "oracle"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
async def test_eight_bit_reads_decode_as_exact_reads_do(runner, selector, kv_dtype):
    """K8V8 reads against the same request reading exact rows (both with the 8-bit push): fed the same tokens,
    every step's next-token distribution is within KL 5e-3 of it (mean ≤ 1e-3; measured ~1e-4 here, as the push's on
    SmolLM2), and Quest's greedy tokens are the same. (The random tiny model's top tokens are close: with Oracle
    over bf16 its 8th greedy token flips, so its tokens are not compared.)"""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    exact_logits, codes_logits = [], []
    exact_tokens, _ = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                          read_codes=False, kv_dtype=kv_dtype, logits=exact_logits)
    _, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                    kv_dtype=kv_dtype, forced=exact_tokens, logits=codes_logits)
    assert remote.codes is not None and remote.bytes_on_demand % remote.entry_bytes == 0 < remote.bytes_on_demand
    kl = [float(torch.nn.functional.kl_div(c.log_softmax(-1), e.log_softmax(-1), log_target=True, reduction="sum"))
          for c, e in zip(codes_logits, exact_logits)]
    assert max(kl) < 5e-3 and sum(kl) / len(kl) < 1e-3, kl
    if selector == "quest":
        tokens, _ = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                        kv_dtype=kv_dtype)
        assert tokens == exact_tokens


@pytest.mark.parametrize("bits", [8, 4])
async def test_with_kv_bits_background_and_ranked_reads_move_records_too(runner, bits):
    """Path 3 with kv_bits: the broker's blocks (`read_blocks`) and the latest query's ranked reads move records
    (bytes_background is records' worth), the request ends all local, and every entry holds its codes' value."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    slabs: dict[str, torch.Tensor] = {}
    _, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=True, kv_bits=bits,
                                    kv_dtype="bfloat16", slabs=slabs)
    record = entry_record_bytes(16, bits)
    assert remote.is_all_local and remote.local_blocks().all()
    assert remote.bytes_background > 0 and remote.bytes_background % record == 0
    assert remote.bytes_on_demand + remote.bytes_background == 6 * 2 * len(ids) * record  # layers 2–7, 2 KV heads
    assert torch.equal(slabs["dst"], dequantized(slabs["src"], bits))
    _, ranked = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False, kv_bits=bits,
                                    kv_dtype="bfloat16", ranked=True, slabs=slabs)
    assert ranked.num_ranked_reads > 0 and ranked.bytes_ranked == ranked.bytes_background > 0
    assert ranked.bytes_ranked % record == 0
    local = torch.from_numpy(ranked.present)[:, None, :, :, None].expand_as(slabs["dst"])
    assert torch.equal(slabs["dst"][local], dequantized(slabs["src"], bits)[local])


async def test_with_kv_bits_step_one_reads_a_layer_only_once_its_pushed_records_are_dequantized(runner):
    """No push barrier, 8-bit push and reads: read records land in the codes region the layer's pushed records
    landed in, so a layer is read (fetched or speculated) only once those were dequantized into its rows; the
    pushed layers' values and the tokens are those of the same request with the push landed before step 1."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    slabs: dict[str, torch.Tensor] = {}
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 4, True, background=False, kv_bits=8,
                                         kv_dtype="bfloat16", land_every_s=0.02, slabs=slabs)
    barrier_tokens, _ = await remote_tokens(runner, ids, "quest", 0.1, 4, True, background=False, kv_bits=8,
                                            kv_dtype="bfloat16")
    assert tokens == barrier_tokens and remote.landing_wait_s > 0.02 and remote.num_speculative_reads > 0
    local = torch.from_numpy(remote.present)[:, None, :, :, None].expand_as(slabs["dst"])
    assert torch.equal(slabs["dst"][local], dequantized(slabs["src"], 8)[local])
    assert remote.bytes_on_demand == int(remote.present[4:].sum()) * entry_record_bytes(16, 8)


async def test_a_layer_is_read_as_codes_only_once_its_pushed_records_are_dequantized():
    """The decode slab's codes region holds a layer's pushed records (in push order) until they are dequantized
    (`ready`), and read records land in it at head·N + token: a read may not land there before. A speculated layer
    that has landed is dequantized first (on the torch thread, never waiting), and path 3 refuses an unprepared
    layer (its batch is read again later). Here the push carries page 0 of layer 2 (records 0–31: head 0's tokens
    0–15, then head 1's) and a read of head 0's token 20 lands on record 20, head 1's token 4's pushed record."""
    layout = layout_for(num_layers=4, num_kv_heads=2, head_dim=16, page_tokens=16, dtype=torch.bfloat16)
    n, bits = 40, 8
    codes = EntryCodes(4, 2, 16, n, bits, offset=0)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 5)
    src_slab, dst_slab = src.allocate("r", n, codes.nbytes), dst.allocate("r", n, codes.nbytes)
    exact = torch.randn(4, 2, 2, n, 16).to(torch.bfloat16)
    for layer in range(4):
        codes.encode(src.aux(src_slab), layer, exact[layer, 0].float(), exact[layer, 1].float(), every_entry(2, n))
    reference = dequantized(exact, bits)
    pushed = np.zeros((4, 3), dtype=bool)
    pushed[2, 0] = True
    mask = np.zeros((2, n), dtype=bool)
    mask[:, :16] = True
    codes.encode(dst.aux(dst_slab), 2, exact[2, 0].float(), exact[2, 1].float(), mask)  # the push has landed
    rows = dst.view(dst_slab)
    rows.fill_(float("nan"))
    prepared = []

    def prepare(layer: int) -> None:  # as the decode engine's loader: the layer's pushed records into its rows
        if layer == 2:
            codes.decode(dst.aux(dst_slab), 2, mask, rows[2, 0, :, :n], rows[2, 1, :, :n])
        prepared.append(layer)
    a, b = make_dataplane("inproc"), make_dataplane("inproc")
    a.register_region(src.region)
    b.register_region(dst.region)
    await a.start()
    await b.start()
    at = src.aux_offset(src_slab)
    a.grant(Grant(7, [(at, at + codes.nbytes)]))
    source = KvSource("p", a.address, 7, src.offset(src_slab), src_slab.capacity, 30.0, at, bits)
    remote = RemoteKv(b, asyncio.get_running_loop(), source, layout, dst.offset(dst_slab), dst_slab.capacity, n,
                      pushed, codes_at=dst.aux_offset(dst_slab), region=dst.region)
    remote.await_pushes(prepare)
    remote.speculate(3, torch.tensor([[20], [21]]))  # layer 3 has not landed: nothing is read ahead
    assert 3 not in remote._ahead and not prepared
    remote.push_landed(2, None)
    with pytest.raises(RemoteReadError, match="not dequantized"):  # path 3 before step 1 prepared the layer
        await read_blocks(remote, [2 * 3 + 1])
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, remote.speculate, 2, torch.tensor([[20], [21]]))  # the torch thread
    assert prepared == [2]
    pending = await loop.run_in_executor(None, remote.fetch, 2, torch.tensor([[20], [21]]))
    assert pending is None  # the speculative read brought both
    local = torch.from_numpy(remote.present[2])[None, :, :, None].expand(2, 2, n, 16)
    assert int(remote.present[2].sum()) == 34 and remote.bytes_on_demand == 2 * codes.record_bytes
    assert torch.equal(rows[2, :, :, :n][local], reference[2][local])
    await remote.close()
