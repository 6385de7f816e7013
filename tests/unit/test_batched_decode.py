"""Continuous batching in the decode engine: requests of different lengths, dense and selective, stepped
together in one forward give exactly the tokens each gives alone; a request joins and leaves between steps;
a row whose remote read fails is the only one that fails."""
from __future__ import annotations

import pytest
import torch

from schemas import NO_FLOOR, Sampling
from shared.compute import selective
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from tests.reference import prompt_ids

PROMPTS = ["Once upon a time, in a valley between two mountains, there lived",
           "The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n    return",
           "List three colours of the rainbow: red,"]
SELECTIVE = {1: ("quest", 0.3), 2: ("quest", 0.25)}  # request index → (selector, budget); the others dense
NUM_STEPS = 12


def engine_for(path) -> DecodeEngine:
    runner = ModelRunner(path)
    return DecodeEngine(runner, KvStore(runner.kv_layout(page_tokens=4), 256), floor=NO_FLOOR)


def start(engine: DecodeEngine, rid: str, ids: list[int], i: int) -> int:
    first = engine.prefill_local(rid, ids, Sampling(), max_new_tokens=NUM_STEPS + 1)
    if i in SELECTIVE:
        engine.use_selection(rid, *SELECTIVE[i])
    return first


def alone(path, prompts: list[list[int]]) -> list[list[int]]:
    engine = engine_for(path)
    out = []
    for i, ids in enumerate(prompts):
        tokens = [start(engine, "r", ids, i)]
        for index in range(1, NUM_STEPS):
            tokens.append(engine.step("r", tokens[-1], Sampling(), index))
        engine.end("r")
        out.append(tokens)
    return out


def together(path, prompts: list[list[int]], join_at: int = 3) -> list[list[int]]:
    """Requests 0–2 start together; request 3 joins at step `join_at`; each leaves when it has NUM_STEPS
    tokens (so they leave at different steps)."""
    engine = engine_for(path)
    tokens: dict[int, list[int]] = {}
    for i in range(3):
        tokens[i] = [start(engine, f"r{i}", prompts[i], i)]
    step = 0
    while any(len(t) < NUM_STEPS for t in tokens.values()) or len(tokens) < len(prompts):
        step += 1
        if step == join_at:
            tokens[3] = [start(engine, "r3", prompts[3], 3)]
        running = [i for i, t in tokens.items() if len(t) < NUM_STEPS]
        logits = engine.step_batch([(f"r{i}", tokens[i][-1]) for i in running])
        for i, row in zip(running, logits):
            assert not isinstance(row, Exception), row
            tokens[i].append(int(torch.argmax(row)))
            if len(tokens[i]) == NUM_STEPS:
                engine.end(f"r{i}")
    assert not engine.caches
    return [tokens[i] for i in range(len(prompts))]


def test_a_batch_decodes_each_request_as_alone(tiny_model_path):
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths, so different positions per row
    assert together(tiny_model_path, prompts) == alone(tiny_model_path, prompts)


@pytest.mark.real_model
def test_a_batch_decodes_each_request_as_alone_real_model(real_model_path):
    """SmolLM2's real attention (selection depends on it): batched tokens equal single-request tokens."""
    prompts = [prompt_ids(real_model_path, p * 8) for p in PROMPTS]  # a few hundred tokens, so quest selects
    assert together(real_model_path, prompts) == alone(real_model_path, prompts)


@pytest.mark.parametrize("budgets", [(0.3, 0.25), (0.3, 0.3)])
def test_selective_rows_select_together(tiny_model_path, monkeypatch, budgets):
    """The batch's two Quest rows (prompts of different lengths; budgets unequal, then equal) make each layer's
    selections together, one `select_rows_with_floor` a layer, and every request's tokens are still its tokens
    alone."""
    monkeypatch.setitem(SELECTIVE, 1, ("quest", budgets[0]))
    monkeypatch.setitem(SELECTIVE, 2, ("quest", budgets[1]))
    calls: list[int] = []
    select_rows = selective.select_rows_with_floor

    def counted(selector, layer, states, *args):
        chosen = select_rows(selector, layer, states, *args)
        calls.append(len(states))  # after: a call that raised (and fell back to row by row) is not counted
        return chosen

    monkeypatch.setattr(selective, "select_rows_with_floor", counted)
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    assert together(tiny_model_path, prompts) == alone(tiny_model_path, prompts)
    assert calls and set(calls) == {2}


def final_hidden(engine: DecodeEngine, steps: list[tuple[str, int]]) -> torch.Tensor:
    """One batched step; the rows (B, hidden) the vocabulary projection gets (the last norm's output)."""
    kept = []
    hook = engine.runner.model.get_decoder().norm.register_forward_hook(lambda _m, _a, out: kept.append(out[:, -1]))
    try:
        engine.step_batch(steps)
    finally:
        hook.remove()
    return kept[0]


@pytest.mark.parametrize("batch", [2, 3, 4, 8])
def test_a_row_computes_bit_for_bit_as_alone_whatever_the_batch(tiny_model_path, batch):
    """Greedy tokens equal only while no rounding differs: a CPU matmul of 1, 2–3 or ≥ 4 rows takes a
    different kernel (a different summation order), which a real prompt turned into a different selection
    and a different token 12 (docs/results/chaos). So every row's state before the vocabulary projection must
    be bit-for-bit what it is alone."""
    engine = engine_for(tiny_model_path)
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    first = start(engine, "alone", prompts[1], 1)  # selective (quest)
    expected = final_hidden(engine, [("alone", first)])[0]
    engine.end("alone")
    start(engine, "same", prompts[1], 1)
    others = [f"other{b}" for b in range(batch - 1)]
    for b, rid in enumerate(others):
        start(engine, rid, prompts[b % len(prompts)], b % len(prompts))
    together = final_hidden(engine, [("same", first)] + [(rid, first) for rid in others])
    assert torch.equal(together[0], expected)


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test (`torch_threads(n)`), and puts it back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def selective_alone(engine: DecodeEngine, prompts: list[list[int]]) -> tuple[int, torch.Tensor]:
    """Request 1 (selective) alone: its first token and its state after one step."""
    first = start(engine, "alone", prompts[1], 1)
    expected = final_hidden(engine, [("alone", first)])[0]
    engine.end("alone")
    return first, expected


@pytest.mark.parametrize("threads", [1, 2])
def test_selective_rows_attended_together_compute_as_alone(tiny_model_path, torch_threads, threads):
    """On more than one thread the selective rows of a step gather and attend together (one SDPA per run of rows of
    one width: selective.py `_attend_selected`); on one, row by row. Either way a row's state is bit for bit its
    state alone, beside rows of its own width and of others."""
    torch_threads(threads)
    engine = engine_for(tiny_model_path)
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    _, expected = selective_alone(engine, prompts)
    rows = [("same", 1), ("twin", 1), ("other", 2), ("dense", 0)]  # two of one width, one of another, one dense
    firsts = {rid: start(engine, rid, prompts[i], i) for rid, i in rows}
    together = final_hidden(engine, [(rid, firsts[rid]) for rid, _ in rows])
    assert torch.equal(together[0], expected) and torch.equal(together[1], expected)


def test_with_one_shared_matmul_a_rows_rounding_depends_on_its_batch(tiny_model_path):
    """Why the default is what it is (and that `batch_invariant: false` is honoured): one shared matmul over a
    batch of 4 rounds the same row differently from the one-row product."""
    engine = engine_for(tiny_model_path)
    engine.runner.batch_invariant = False
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    first = [start(engine, f"r{i}", ids, i) for i, ids in enumerate(prompts)]
    alone = final_hidden(engine, [("r0", first[0])])[0]
    engine.end("r0")
    start(engine, "r0", prompts[0], 0)
    together = final_hidden(engine, [(f"r{i}", first[i]) for i in range(4)])[0]
    assert not torch.equal(together, alone)
    assert torch.allclose(together, alone, atol=1e-4)


class FailingRemote:
    """A request whose KV is partly remote and whose reads fail."""

    parallel = True

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def ready(self, layer) -> None:
        pass

    def is_ready(self, layer) -> bool:
        return True

    def fetch(self, layer, idx):
        raise RuntimeError("the prefill node is gone")


def test_a_failed_read_fails_only_its_row(tiny_model_path):
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS[:2]]
    engine = engine_for(tiny_model_path)
    first = [start(engine, f"r{i}", ids, i) for i, ids in enumerate(prompts)]
    engine.selections["r1"].remote = FailingRemote()
    good, failed = engine.step_batch([("r0", first[0]), ("r1", first[1])])
    assert isinstance(failed, RuntimeError) and "gone" in str(failed)
    assert int(torch.argmax(good)) == alone(tiny_model_path, prompts[:1])[0][1]


class _ReadThatFails:
    def __init__(self, idx: torch.Tensor):
        self.remote = torch.zeros_like(idx, dtype=torch.bool)

    def wait(self) -> None:
        raise RuntimeError("the read timed out")


class RemoteWhoseReadsFail(FailingRemote):
    """A request whose selective layers' reads start, then fail when waited on (after the gather)."""

    def fetch(self, layer, idx):
        return None if idx is None else _ReadThatFails(idx)

    def wants_ranking(self, layer) -> bool:
        return False

    def wants_speculation(self, layer) -> bool:
        return False


def test_a_read_that_fails_while_rows_attend_together_fails_only_its_row(tiny_model_path, torch_threads):
    """Two threads, three selective rows of one width (gathered and attended together): the one whose read fails
    when waited on is the only one that fails; its twin's state is bit for bit its state alone."""
    torch_threads(2)
    engine = engine_for(tiny_model_path)
    prompts = [prompt_ids(tiny_model_path, p) for p in PROMPTS]
    first, expected = selective_alone(engine, prompts)
    rows = ["failing", "twin", "triplet"]
    for rid in rows:
        start(engine, rid, prompts[1], 1)
    engine.selections["failing"].remote = RemoteWhoseReadsFail()
    kept = []
    hook = engine.runner.model.get_decoder().norm.register_forward_hook(lambda _m, _a, out: kept.append(out[:, -1]))
    try:
        failed, *others = engine.step_batch([(rid, first) for rid in rows])
    finally:
        hook.remove()
    assert isinstance(failed, RuntimeError) and "timed out" in str(failed)
    assert all(isinstance(logits, torch.Tensor) for logits in others)
    assert torch.equal(kept[0][1], expected) and torch.equal(kept[0][2], expected)
