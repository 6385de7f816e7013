"""Selective decoding over a partly remote cache (paths 2 and 3) with the network reduced to the in-process
data plane: the same tokens as with every entry local, reads only of what is missing, and presence that
ends all local."""
from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest

from schemas import NO_FLOOR, KvSource, Sampling
from shared.compute.decode_engine import DecodeEngine
from services.decode.background import read_blocks, read_ranked
from services.decode.remote import RemoteKv, RemoteReadError
from shared.compute.prefill_engine import PrefillEngine
from shared.dataplane import Grant, make_dataplane
from shared.compute.kvstore import KvStore
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
                        land_every_s: float = 0.0, ranked: bool = False):
    """Prefill on one store, push metadata and the first `pushed_layers` layers to another, decode there with
    the rest read over the in-process data plane (`calls`, if given, counts its `read` and `read_gather` calls).
    The decode slab starts as NaN, so any entry used before it arrived would poison the output. `land_every_s`:
    no push barrier, the push lands a layer every this many seconds while step 1 runs. `ranked`: path 3 by the
    latest query runs while decoding (`read_ranked`)."""
    layout = runner.kv_layout(16)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 7)  # different offsets on the two sides
    n = len(ids)
    prefill = PrefillEngine(runner, src)
    meta, _ = prefill.metadata_encoder(src.allocate("probe", 1), selector, n)  # sizes only
    src.free("probe")
    src_slab = src.allocate("r", n, meta.nbytes)
    dst_slab = dst.allocate("r", n + STEPS, meta.nbytes)
    dst.view(dst_slab).fill_(float("nan"))
    _, encode = prefill.metadata_encoder(src_slab, selector, n)
    first = prefill.run(src_slab, ids, Sampling(), lambda layer: None, encode)

    def push_layer(layer: int) -> None:  # its metadata, and its rows if the plan pushes them
        if layer >= 2:
            at, length = meta.layer_range(layer)
            dst.aux(dst_slab)[at: at + length] = src.aux(src_slab)[at: at + length]
        if layer < pushed_layers:
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
    a.grant(Grant(ticket, [(off, off + ln) for layer in range(layout.num_layers) for off, ln in src.rows(src_slab, layer, 0, n)]))
    pages = -(-n // 16)
    pushed = np.zeros((layout.num_layers, pages), dtype=bool)
    pushed[:pushed_layers] = True
    source = KvSource("p", a.address, ticket, src.offset(src_slab), src_slab.capacity, 30.0)
    remote = RemoteKv(b, asyncio.get_running_loop(), source, layout, dst.offset(dst_slab), dst_slab.capacity, n,
                      pushed, parallel, gather_reads=gather, speculative=speculative, ranked=ranked)
    engine = DecodeEngine(runner, dst, floor=NO_FLOOR)
    loop = asyncio.get_running_loop()
    engine.load_from_store("r", dst_slab, n)
    landing = None
    if land_every_s:
        remote.await_pushes(None)

        async def land() -> None:
            for layer in range(layout.num_layers):
                await asyncio.sleep(land_every_s)
                push_layer(layer)
                remote.push_landed(layer, None)
        landing = asyncio.create_task(land())
    engine.use_selection("r", selector, budget, slab=dst_slab, remote=remote, lazy=bool(land_every_s))
    ranked_reads = asyncio.create_task(read_ranked(remote)) if ranked else None
    tokens = [first]
    for i in range(1, STEPS):
        tokens.append(await loop.run_in_executor(None, engine.step, "r", tokens[-1], Sampling(), i))  # a torch thread
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
