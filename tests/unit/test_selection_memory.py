"""The selection's memory (schemas BudgetFloor.stick, shared/compute/floor.py): entries a request's earlier steps
selected at a layer score `stick` standard deviations higher, so the union of its selections grows slower."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from schemas import BudgetFloor, Sampling
from shared.compute import selective
from shared.compute.decode_engine import DecodeEngine
from shared.compute.floor import remember_picks, select_with_floor
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import Geometry, LayerState, Selector, default_prep_dir
from tests.reference import prompt_ids
from tools.tiny_model import make_tiny_model

BARE = BudgetFloor(min_tokens=1, dense_below=0, sinks=0, recent=0, stick=0.0)


class FixedScores(Selector):
    """Scores given by the test: (num_kv_heads, n)."""
    name = "fixed"

    def __init__(self, scores: torch.Tensor):
        super().__init__(Geometry(num_layers=4, num_heads=scores.shape[0], num_kv_heads=scores.shape[0], head_dim=8))
        self.scores = scores

    def metadata_bytes_per_token(self) -> float:
        return 0.0

    def metadata_specs(self, num_tokens: int):
        return []

    def new_state(self, layer: int) -> LayerState:
        return LayerState()

    def extend(self, layer, state, keys) -> None:
        state.num_tokens = keys.shape[1]

    def export(self, state):
        return []

    def restore(self, layer, tensors, num_tokens):
        return LayerState()

    def select(self, layer, state, query, k):
        return torch.topk(self.scores, k, dim=1).indices.sort(dim=1).values

    def token_scores(self, layer, state, query, k):
        return self.scores.clone(), k


def test_an_earlier_pick_wins_where_scores_are_close_and_only_there():
    # token 1 scores a little below token 0 (0.1 of a std of ~4.6), token 3 far below (2 stds)
    scores = torch.tensor([[10.0, 9.9, 0.0, 0.5, 1.0, 2.0, 0.0, 0.0]])
    selector, state, query = FixedScores(scores), LayerState(), torch.zeros(1, 8)
    n = scores.shape[1]
    assert select_with_floor(selector, 2, state, query, 1, n, BARE).tolist() == [[0]]
    remember_picks(state, torch.tensor([[1, 3]]), n, dataclasses.replace(BARE, stick=0.5))
    sticky = dataclasses.replace(BARE, stick=0.5)
    assert select_with_floor(selector, 2, state, query, 1, n, sticky).tolist() == [[1]]  # 9.9 + 0.5 σ > 10
    assert select_with_floor(selector, 2, state, query, 2, n, sticky).tolist() == [[0, 1]]  # 3 stays out: 0.5 + 2.3 < 9.9
    assert select_with_floor(selector, 2, state, query, 1, n, BARE).tolist() == [[0]]  # stick 0: no memory


def test_remember_marks_prompt_entries_and_ignores_later_tokens():
    state = LayerState()
    floor = dataclasses.replace(BARE, stick=1.0)
    remember_picks(state, torch.tensor([[0, 2], [1, 3]]), 4, floor)
    remember_picks(state, torch.tensor([[2, 5], [3, 4]]), 6, floor)  # tokens 4 and 5 came after the first step
    assert state.picked.shape == (2, 5)
    assert state.picked[:, :4].tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]
    remember_picks(LayerState(), torch.tensor([[0]]), 4, BARE)  # stick 0: nothing kept


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, real_model_path):
    folder = tmp_path_factory.mktemp("tiny-memory")
    make_tiny_model(folder, tokenizer_from=real_model_path)
    runner = ModelRunner(folder)
    return runner, folder, prompt_ids(folder, "The quick brown fox jumps over the lazy dog. " * 40)


@pytest.mark.parametrize("selector", ["hata", "infinigen", "keycodes"])
def test_memory_shrinks_the_union_of_a_requests_selections(tiny, selector, monkeypatch):
    """Decoding 16 steps at 10%: with memory the selections cover fewer prompt entries in all, step 1 picks the same."""
    runner, folder, ids = tiny
    unions, firsts = {}, {}
    select = selective.select_with_floor
    for stick in (0.0, 1.0):
        floor = BudgetFloor(min_tokens=8, dense_below=0, sinks=4, recent=8, stick=stick)
        engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), default_prep_dir(folder), floor)
        picked: dict[int, set] = {}
        first: list[torch.Tensor] = []

        def recording(sel_, layer, state, probe, k, n, floor_):
            idx = select(sel_, layer, state, probe, k, n, floor_)
            if layer not in picked:
                first.append(idx.clone())
            picked.setdefault(layer, set()).update((h, t) for h in range(idx.shape[0]) for t in idx[h].tolist()
                                                   if t < len(ids))
            return idx
        monkeypatch.setattr(selective, "select_with_floor", recording)
        token = engine.prefill_local("r", ids, Sampling())
        engine.use_selection("r", selector, 0.1)
        for i in range(1, 16):
            token = engine.step("r", token, Sampling(), i)
        engine.end("r")
        unions[stick] = sum(len(v) for v in picked.values())
        firsts[stick] = first
    assert all(torch.equal(a, b) for a, b in zip(firsts[0.0], firsts[1.0]))
    assert unions[1.0] < 0.9 * unions[0.0], unions


def test_a_page_selector_keeps_no_memory(tiny):
    """Quest scores whole pages and never reads the selection's memory, so its steps do not keep one (a scatter per
    layer and row saved); the sticky floor still applies to the selectors that rank tokens."""
    runner, folder, ids = tiny
    floor = BudgetFloor(min_tokens=8, dense_below=0, sinks=4, recent=8, stick=1.0)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), default_prep_dir(folder), floor)
    for name, selector in (("q", "quest"), ("h", "hata")):
        token = engine.prefill_local(name, ids, Sampling())
        engine.use_selection(name, selector, 0.1)
        for i in range(1, 4):
            token = engine.step(name, token, Sampling(), i)
    picked = {name: [s.picked for s in engine.selections[name].states.values()] for name in ("q", "h")}
    assert picked["q"] and all(p is None for p in picked["q"])
    assert picked["h"] and all(p is not None for p in picked["h"])
