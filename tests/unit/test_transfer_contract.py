"""The transfer contract (schemas/modes.py, schemas/geometry.py): the mode table is consistent, auto resolves only to what it
declares, the one kv_budget rule, and the plan geometry on which prefill (what it pushes) and decode (what it
waits for) must agree to the byte. Also the decode request's phases and the pub/sub `subscriber` wrapper."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import schemas
from schemas import (KV_BITS, MODES, SELECTIVE_MODES, TRANSFER_MODES, KvLayout, OpenPlan, TransferPlan, budget_tokens,
                     kv_budget_problem, mode_of, modes_where, pack_bits, plan_problem, pushed_bytes, pushed_runs)
from schemas.modes import Aux, Push
from services.broker.planner import LinkEstimate, choose_mode
from services.decode.remote_lifecycle import is_released
from services.decode.request import DecodeRequest, Phase, PhaseError
from shared.compute.kvstore import KvStore, layout_for
from shared.runtime.rpc import subscriber

LAYOUT = layout_for(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=16, dtype=torch.float32)
N = 40  # 3 pages per layer, the last one half full


def plan(mode: str, blocks: np.ndarray | None = None) -> TransferPlan:
    pages = math.ceil(N / LAYOUT.page_tokens)
    flags = blocks if blocks is not None else np.zeros((LAYOUT.num_layers, pages), dtype=bool)
    return TransferPlan("r", mode, "b", pages, pack_bits(flags), int(flags.sum()))


def test_every_mode_row_is_consistent():
    """Selective modes keep their source and push metadata and plan blocks; a needed selector is an allowed one;
    kv_bits only where codes travel; auto resolves to disaggregated, resolved modes only."""
    assert TRANSFER_MODES == tuple(MODES) and set(SELECTIVE_MODES) == {"partial", "smartgen"}
    for mode in MODES.values():
        if mode.keeps_source or mode.is_selective:
            assert mode.is_selective and mode.keeps_source and mode.aux is Aux.METADATA and mode.pushes is Push.PLAN_BLOCKS
        assert not mode.needs_selector or mode.allows_selector
        assert set(mode.kv_bits) <= set(KV_BITS) and bool(mode.kv_bits) == (mode.aux is Aux.CODES)
        assert mode.is_disaggregated or (mode.pushes is Push.NOTHING and mode.aux is Aux.NONE)
        for target in mode.resolves_to:
            assert MODES[target].is_resolved and MODES[target].is_disaggregated and mode.may_run_as(target)
    assert modes_where(is_disaggregated=False) == ("colocated",)


def test_an_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="teleport.*colocated, full"):
        mode_of("teleport")


@pytest.mark.parametrize("ratio", [0.5, 4.0])
def test_auto_resolves_to_one_of_its_declared_modes(ratio):
    """The broker's choice (planner.choose_mode) is one of MODES["auto"].resolves_to, whatever the link."""
    lay = KvLayout(30, 3, 64, 16, "float32", 46080)
    rate = 200.0
    gbps = 2048 * lay.token_bytes * 8 / (ratio * 2048 / rate) / 1e9
    mode, reason = choose_mode(OpenPlan("r", "auto", "m", "quest", 2048, lay, 0, "p", "d"),
                               LinkEstimate(gbps, rate, "measured"))
    assert mode in MODES["auto"].resolves_to and reason
    assert mode == ("full" if ratio <= 1 else "smartgen")


@pytest.mark.parametrize("value", [0.1, 1, 1.0, 5, 5.0, 4096])
def test_kv_budget_rule_takes_fractions_and_whole_token_counts(value):
    assert kv_budget_problem(value, max_tokens=4096) == ""


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "0.1", None, float("nan"), float("inf"), 10**400, 4097])
def test_kv_budget_rule_refuses_the_rest(value):
    assert "fraction in (0, 1]" in kv_budget_problem(value, max_tokens=4096)


def test_budget_tokens_rounds_fractions_up_and_caps_counts():
    assert budget_tokens(0.1, 2048) == 205 and budget_tokens(64, 2048) == 64 and budget_tokens(64, 10) == 10
    assert budget_tokens(0.001, 10) == 1


def test_full_pushes_every_row_and_quantized_only_its_codes():
    lay_token = LAYOUT.token_bytes // LAYOUT.num_layers
    assert pushed_runs(mode_of("full"), None, LAYOUT, N) == [[(0, N)]] * LAYOUT.num_layers
    assert pushed_bytes(mode_of("full"), None, LAYOUT, N, aux_bytes=999) == N * LAYOUT.token_bytes == 4 * N * lay_token
    assert pushed_bytes(mode_of("quantized"), None, LAYOUT, N, aux_bytes=999) == 999


@pytest.mark.parametrize("mode", ["partial", "smartgen"])
def test_what_prefill_pushes_is_what_decode_waits_for(mode):
    """The rows prefill turns into segments (KvStore.rows over pushed_runs) add up, with the aux area, to exactly
    pushed_bytes: the count decode waits for before its first step. A partial last page counts its real tokens."""
    blocks = np.zeros((LAYOUT.num_layers, 3), dtype=bool)
    blocks[0] = True  # a whole layer
    blocks[2, 2] = True  # the half-full last page
    blocks[3, [0, 2]] = True  # two runs in one layer
    p = plan(mode, blocks)
    runs = pushed_runs(mode_of(mode), p, LAYOUT, N)
    assert runs == [[(0, N)], [], [(32, N)], [(0, 16), (32, N)]]
    store = KvStore(LAYOUT, num_pages=8)
    slab = store.allocate("r", N)
    segment_bytes = sum(length for layer, layer_runs in enumerate(runs) for start, stop in layer_runs
                        for _, length in store.rows(slab, layer, start, stop))
    aux = 1234
    assert pushed_bytes(mode_of(mode), p, LAYOUT, N, aux) == aux + segment_bytes


def test_a_plan_for_another_prompt_is_refused():
    assert plan_problem(plan("smartgen"), LAYOUT.num_layers, N, LAYOUT.page_tokens) == ""
    assert "does not describe" in plan_problem(plan("smartgen"), LAYOUT.num_layers, N + 16, LAYOUT.page_tokens)
    assert "does not describe" in plan_problem(plan("smartgen"), 3 * LAYOUT.num_layers, N, LAYOUT.page_tokens)


def test_decode_request_phases_move_only_forward_along_the_life_cycle():
    state = DecodeRequest("r", mode_of("smartgen"))
    assert state.phase is Phase.RESERVED and not is_released(state)
    state.advance(Phase.PREPARING)
    with pytest.raises(PhaseError, match="preparing → finishing"):
        state.advance(Phase.FINISHING)
    state.advance(Phase.RUNNING)
    state.advance(Phase.FINISHING)
    with pytest.raises(PhaseError):
        state.advance(Phase.RUNNING)
    aborted = DecodeRequest("a", mode_of("full"))
    aborted.advance(Phase.PREPARING)
    aborted.advance(Phase.ABORTED)
    with pytest.raises(PhaseError):
        aborted.advance(Phase.RUNNING)


async def test_subscriber_drops_what_does_not_decode_and_hands_on_the_rest():
    seen: list[schemas.KeepLease] = []

    async def keep(message: schemas.KeepLease) -> None:
        seen.append(message)

    on_msg = subscriber(schemas.KeepLease, keep)
    await on_msg(SimpleNamespace(subject="s", data=b"\xc1 not msgpack"))
    await on_msg(SimpleNamespace(subject="s", data=schemas.encode(schemas.Abort("r", "x"))))
    assert seen == []
    await on_msg(SimpleNamespace(subject="s", data=schemas.encode(schemas.KeepLease("r1"))))
    await asyncio.sleep(0)
    assert seen == [schemas.KeepLease("r1")]


def test_ttst_bound_adds_only_the_step1_bytes_the_prefill_could_not_hide():
    """ttst_bound_s = all-local step time + max(0, B₁ − r·T_prefill)/r; nothing to add when B₁ fits behind the
    prefill, or when nothing crosses a link (colocated, unpaced)."""
    from services.gateway.completion import CompletionRun
    from services.gateway.report import ttst_bound_s
    from services.gateway.requests import CompletionJob

    job = CompletionJob("r", "completion", [1, 2, 3], 8, 0.0, 0, [], False, "smartgen", "quest", 0.1)
    run = CompletionRun(None, None, job, [], 10.0)  # type: ignore[arg-type]
    assert ttst_bound_s(run) is None  # not finished
    run.final = schemas.TokenEvent("r", 8, -1, "length", step1_kv_bytes=3_000_000, step1_compute_s=0.1)
    run.plan = TransferPlan("r", "smartgen", "b", 1, link_gbps=0.008)  # 1 MB/s
    run.prefill_s = 2.0  # 2 MB ride behind the prefill, 1 MB is left: 1 s
    assert ttst_bound_s(run) == pytest.approx(1.1)
    run.prefill_s = 5.0
    assert ttst_bound_s(run) == pytest.approx(0.1)
    run.plan = None  # colocated
    assert ttst_bound_s(run) == pytest.approx(0.1)


def test_the_budget_floor():
    """Dense below the context threshold; above it, at least the minimum; a generous budget is left alone."""
    floor = schemas.DEFAULT_FLOOR
    assert floor.tokens(0.1, 38) == 38 and floor.tokens(0.1, 1023) == 1023  # dense: every token
    assert floor.tokens(0.01, 2048) == floor.min_tokens == 128 and floor.tokens(0.1, 2048) == 205
    assert schemas.NO_FLOOR.tokens(0.1, 38) == 4


def test_sinks_and_the_recent_window_are_always_selected():
    """Every KV head's selection gets the first and last tokens, without duplicates; heads end equally long,
    the shorter ones topped up with their most recent tokens not yet in."""
    from shared.compute.floor import _with_sinks_and_recent

    idx = _with_sinks_and_recent(torch.tensor([[0, 18], [7, 9]]), n=20, sinks=2, recent=3)
    assert idx.tolist() == [[0, 1, 15, 16, 17, 18, 19], [0, 1, 7, 9, 17, 18, 19]]
