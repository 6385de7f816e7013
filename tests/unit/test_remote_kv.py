"""Selective decoding over a partly remote cache (paths 2 and 3) with the network reduced to the in-process
data plane: the same tokens as with every entry local, reads only of what is missing, and presence that
ends all local."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from schemas import KvSource
from services.decode.remote import RemoteKv, RemoteReadError
from shared.dataplane import make_dataplane
from tests.reference import prompt_ids
from tests.unit.remote_kv_harness import PROMPT, STEPS, colocated_tokens, remote_tokens, runner  # noqa: F401 (fixture)


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


@pytest.mark.parametrize("selector", ["quest", "hata_untrained"])
@pytest.mark.parametrize("kv_bits", [0, 8])
async def test_direct_reads_give_the_all_local_tokens(runner, selector, kv_bits):
    """Over TCP, path 2's reads sent and received by the torch thread itself (exact rows, or records of codes):
    every fetch read goes direct, and the tokens are those of every entry local (exact KV) or of the same reads
    through the event loop (codes)."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, direct=True,
                                         kv_bits=kv_bits, speculative=False)
    assert remote.num_direct_reads == remote.num_fetch_reads > 0 and remote.bytes_direct > 0
    assert remote.bytes_on_demand == 0  # none went through the loop
    if kv_bits:
        via_loop, _ = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=kv_bits,
                                          speculative=False)
        assert tokens == via_loop
    else:
        assert tokens == colocated_tokens(runner, ids, selector, 0.1)


async def test_a_broken_direct_link_falls_back_to_the_loop(runner):
    """The torch thread's link is dropped after step 3 (its peer's link was lost): the reads after it go through
    the event loop, nothing fails, and the tokens stay those of every entry local."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False, direct=True,
                                         speculative=False, break_direct_after=3)
    assert tokens == colocated_tokens(runner, ids, "quest", 0.1)
    assert 0 < remote.num_direct_reads < remote.num_fetch_reads
    assert remote.bytes_on_demand > 0 and remote.bytes_direct > 0


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


async def test_a_direct_read_nobody_waited_for_lands_at_the_end_of_its_step(runner):
    """A step that fails after a layer started its direct read never waits for it: the step's end (`end_step`,
    always run) lands it, so no reply of it can reach the slab once the request has moved on, and the next
    read on the link is not confused by it."""
    from services.decode.direct_reads import DirectReads
    from shared.dataplane import Grant

    layout = runner.kv_layout(16)
    a, b = make_dataplane("tcp"), make_dataplane("tcp")
    ra, rb = bytearray(1 << 20), bytearray(1 << 20)
    ra[:] = np.random.default_rng(0).bytes(len(ra))
    a.register_region(memoryview(ra))
    b.register_region(memoryview(rb))
    await a.start()
    await b.start()
    direct = DirectReads(b, memoryview(rb), True, 10.0)
    try:
        a.grant(Grant(9, [(0, len(ra))]))
        direct.open(a.address)
        while a.address not in direct.readers:
            await asyncio.sleep(0.005)
        capacity, n = 32, 32
        remote = RemoteKv(b, asyncio.get_running_loop(), KvSource("p", a.address, 9, 0, capacity, 30.0), layout,
                          0, capacity, n, np.zeros((layout.num_layers, 2), dtype=bool), direct=direct)

        def step_that_fails_half_way() -> None:  # the torch thread
            remote.begin_step()
            try:
                pending = remote.fetch(3, None)  # layer 3, every token: started, never waited for
                assert pending is not None and direct.pending
            finally:
                remote.end_step()

        await asyncio.to_thread(step_that_fails_half_way)
        assert not direct.pending and remote.presence.present[3].all() and remote.num_direct_reads == 1
        start, stop = remote.presence.dst_rows[3, 0, 0], remote.presence.dst_rows[3, 1, -1] + n * remote.presence.token_bytes
        assert rb[start:stop] == ra[start:stop]  # same offsets and capacity on both sides here
        await remote.close()
    finally:
        await direct.close()
        await a.close()
        await b.close()


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
    assert remote.bytes_on_demand == plain.bytes_on_demand > 0 and (remote.presence.present == plain.presence.present).all()
    assert "read_gather" not in by_segments and "read" not in by_gather
    selective_layers, steps = remote.presence.present.shape[0] - 2, STEPS - 1
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


async def test_a_speculated_query_is_made_once_a_step(runner, monkeypatch):
    """A selector that selects by a speculated query (InfiniGen) gets layer i's query, speculated from layer i-1's
    input, once a step: the speculation run while layer i-1 is issued and layer i's own selection share it (each
    is a q_proj, its norm and RoPE, ~0.1 ms a layer on this CPU). Quest made to select that way stands in (the
    tiny model has no InfiniGen preparation); its tokens stay those of every entry local."""
    from shared.compute import selective
    from shared.compute.selectors.quest import QuestSelector

    monkeypatch.setattr(QuestSelector, "speculates", True, raising=False)
    made: list[int] = []
    real = selective.speculated_query

    def counted(step, decoder_layer, from_layer, b):
        made.append(from_layer)
        return real(step, decoder_layer, from_layer, b)
    monkeypatch.setattr(selective, "speculated_query", counted)
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False)
    assert remote.num_speculative_reads > 0  # both users were there
    made_remote = len(made)
    made.clear()
    assert tokens == colocated_tokens(runner, ids, "quest", 0.1)
    selective_layers, steps = remote.presence.present.shape[0] - 2, STEPS - 1
    assert made_remote == len(made) == selective_layers * steps  # all local: one a layer and step; remote: the same


async def test_speculative_reads_go_direct_too(runner):
    """With a direct link, the reads a layer starts a layer early (`speculate`) go on it as its fetches do, not
    through the event loop (where they cost InfiniGen 22% TBT against not speculating at all:
    docs/results/speculation-2026-12-07); the tokens stay those of every entry local."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False, direct=True)
    assert tokens == colocated_tokens(runner, ids, "quest", 0.1)
    assert remote.num_speculative_reads > 0
    assert remote.num_direct_reads == remote.num_fetch_reads + remote.num_speculative_reads
    assert remote.bytes_on_demand == 0  # none went through the loop


@pytest.mark.parametrize("selector", ["quest", "oracle", "hata_untrained"])  # HATA's ranking reuses its step's scores
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


@pytest.mark.parametrize("direct", [False, True])
async def test_background_makes_everything_local(runner, direct):
    """Reading every block in the background ends with no entry missing; tokens are unchanged. With direct reads
    (TCP) too, where background replies come in whole frames."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=True, direct=direct)
    assert tokens == colocated_tokens(runner, ids, "quest", 0.1)
    assert remote.is_all_local and remote.bytes_background > 0
    assert remote.step_local_share[-1] == 1.0 and remote.local_blocks().all()


async def test_a_closed_remote_refuses_new_reads(runner):
    """After close (the lease is released), a fetch is an error, not a read into freed pages."""
    ids = prompt_ids(runner.path, PROMPT)[:100]
    _, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False)
    with pytest.raises(RemoteReadError):
        remote.fetch(3, None)

