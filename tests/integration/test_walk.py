"""tools/walk.py on a real in-process stack (the tiny model): one full-mode request's walk."""
from __future__ import annotations

from pathlib import Path

from tools.walk import measure


def test_walk_is_measured_and_repeatable(tiny_model_path: Path):
    """The decode and prefill walks start at their handlers, count sane numbers, and two runs agree."""
    first = {w.name: w for w in measure("full", str(tiny_model_path))}
    second = {w.name: w for w in measure("full", str(tiny_model_path))}
    generate, prefill = first["decode.generate"], first["prefill.prefill"]
    assert any(f.endswith(".generate") for f in generate.functions), generate.functions[:10]
    assert any(f.endswith(".prefill") and f.startswith("services/prefill/") for f in prefill.functions)
    for walk in first.values():
        assert walk.stops >= walk.files > 1 and walk.returns == walk.stops - walk.files, walk
    assert any(name.startswith("decode.generate steady step") for name in first)
    assert generate.stops > first[next(n for n in first if "steady" in n)].stops
    assert [(w.name, w.stops, w.files, w.returns, w.functions) for w in first.values()] == \
        [(w.name, w.stops, w.files, w.returns, w.functions) for w in second.values()]
