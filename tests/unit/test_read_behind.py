"""A step that does not stall (a request ablating "stall", services/decode/read_behind.py): the selection's rule
with entries absent, and a decode over a partly remote cache on a slow in-process link that never waits after
step 1, never attends to an entry before it landed, and brings the missed entries over behind the steps."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from schemas import BudgetFloor
from shared.compute.floor import select_with_floor
from shared.compute.selectors.base import LayerState, top_k
from tests.reference import prompt_ids
from tests.unit.remote_kv_harness import PROMPT, STEPS, remote_tokens, runner  # noqa: F401 (fixture)

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone (pyproject.toml, markers)


class FixedScores:
    """A selector that ranks tokens by fixed scores (num_kv_heads, n)."""

    ranks_tokens = True

    def __init__(self, scores: torch.Tensor):
        self.scores = scores
        self.geometry = type("G", (), {"num_kv_heads": scores.shape[0]})()

    def token_scores(self, layer, state, query, k):
        return self.scores.clone(), k

    def select(self, layer, state, query, k):
        return top_k(self.scores, k)


def test_absent_entries_give_way_to_the_best_local_ones_and_are_picked_in_order_where_too_few_are_local():
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0], [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]])
    absent = torch.tensor([[True, False, True, False, False, False], [True, True, True, True, True, False]])
    floor = BudgetFloor(dense_below=0, min_tokens=0, sinks=0, recent=0, stick=0.0)
    state = LayerState()
    picked = select_with_floor(FixedScores(scores), 2, state, torch.zeros(2, 4), 3, 6, floor)
    assert picked.tolist() == [[0, 1, 2], [0, 1, 2]]  # nothing absent: the top three
    picked = select_with_floor(FixedScores(scores), 2, state, torch.zeros(2, 4), 3, 6, floor, absent)
    # row 0: the best three local ones; row 1 has one local entry: it, then the best two absent ones
    assert picked.tolist() == [[1, 3, 4], [0, 1, 5]]


@pytest.mark.parametrize("stalls", [True, False])
async def test_a_step_that_does_not_stall_never_waits_after_step_1_and_reads_the_missed_entries_behind(runner, stalls):
    """Layers 0–1 pushed, the rest remote, every read 60 ms late. Stalling, later steps wait for the entries their
    selections drift to; not stalling, no step after the first waits a read's time, every missed entry is read
    behind and lands (present at the end), and the logits stay finite (the decode slab starts as NaN: an entry
    attended before its bytes landed would poison them)."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    logits: list[torch.Tensor] = []
    tokens, remote = await remote_tokens(runner, ids, "hata_untrained", 0.1, 2, True, background=False,
                                         read_delay_s=0.06, gather=False, logits=logits, stalls=stalls)
    assert len(tokens) == STEPS and all(torch.isfinite(x).all() for x in logits)
    later_wait_s = max(remote.step_wait[1:])
    if stalls:
        assert later_wait_s >= 0.06 and remote.behind is None  # the selections drift: some step waited for a read
        return
    assert later_wait_s < 0.03, remote.step_wait
    behind = remote.behind
    assert behind.num_substituted > 0 and behind.num_reads > 0
    await asyncio.sleep(0.2)  # the last step's reads behind land after the request's end
    asked = torch.from_numpy(behind.asked)
    assert bool(asked.any()) and bool(torch.from_numpy(remote.presence.present)[asked].all())  # all landed by close
    assert all(math.isclose(share, 1.0) for share in remote.step_local_share[1:])  # attention read local entries only
