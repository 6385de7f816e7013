"""Where one Quest selection goes at 2K (one thread, one layer, µs a call), against positional (no selection work):
extend by one token, the floor mask, mark, mask to indices, the whole select_with_floor.

    python docs/results/select-together-2026-12-07/qparts.py
"""
import time, statistics, torch
torch.set_num_threads(1)
from schemas import DEFAULT_FLOOR
from shared.compute.selectors import make_selector
from shared.compute.selectors.base import Geometry
from shared.compute import floor as F
g = Geometry(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16)
for name in ("quest", "positional"):
    sel = make_selector(name, g)
    n = 2048
    keys = torch.randn(3, n + 200, 64)
    st = sel.new_state(5); sel.extend(5, st, keys[:, :n])
    q = torch.randn(9, 64)
    k = n // 10
    fl = DEFAULT_FLOOR
    def t(f, reps=200):
        s = time.perf_counter()
        for _ in range(reps): f()
        return (time.perf_counter() - s) / reps * 1e6
    res = {}
    m = n
    def ext():
        global m
        m += 1
        sel.extend(5, st, keys[:, :m])
    res["extend"] = t(ext, 150)
    n2 = st.num_tokens
    res["floor_mask"] = t(lambda: F._floor_mask(3, n2, fl.sinks, fl.recent, q.device))
    mask = F._floor_mask(3, n2, fl.sinks, fl.recent, q.device)
    kept = min(n2, fl.sinks + fl.recent); picks = max(1, k - kept)
    res["mark"] = t(lambda: sel.mark(5, st, q, picks, mask.clone()))
    sel.mark(5, st, q, picks, mask)
    res["mask_indices"] = t(lambda: F._mask_indices(mask.clone(), n2))
    res["clone"] = t(lambda: mask.clone())
    res["select_with_floor"] = t(lambda: F.select_with_floor(sel, 5, st, q, k, n2, fl))
    print(name, {a: round(b, 1) for a, b in res.items()}, "µs", fl)
