"""Quest page-bound forms, per bound, one thread, interleaved: one product per query head then the group sum (before),
the group summed first as (kv, 1, d) x (kv, d, P) (now, `bmm_row`), the same as a GEMV (kv, P, d) x (kv, d, 1) (`gemv`; `mv`
per head), and an elementwise mul-sum.

    python docs/results/select-together-2026-12-07/bound_forms.py
"""
import statistics, time, torch, sys
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
def before(lo, hi, q):
    return torch.baddbmm(torch.bmm(q.clamp(max=0), lo.transpose(1, 2)), q.clamp(min=0), hi.transpose(1, 2)).sum(1)
def mv(lo, hi, q):
    up = q.clamp(min=0).sum(1); down = q.clamp(max=0).sum(1)
    return torch.stack([torch.mv(lo[h], down[h]).add_(torch.mv(hi[h], up[h])) for h in range(lo.shape[0])])
def bmm_row(lo, hi, q):  # (kv,1,d) @ (kv,d,P)
    up = q.clamp(min=0).sum(1, keepdim=True); down = q.clamp(max=0).sum(1, keepdim=True)
    return torch.baddbmm(torch.bmm(down, lo.transpose(1, 2)), up, hi.transpose(1, 2))[:, 0]
def gemv(lo, hi, q):  # (kv,P,d) @ (kv,d,1)
    up = q.clamp(min=0).sum(1)[..., None]; down = q.clamp(max=0).sum(1)[..., None]
    return torch.baddbmm(torch.bmm(lo, down), hi, up)[..., 0]
def mulsum(lo, hi, q):
    up = q.clamp(min=0).sum(1, keepdim=True); down = q.clamp(max=0).sum(1, keepdim=True)
    return (lo * down).addcmul_(hi, up).sum(-1)
for n in (2048, 4096, 8192):
    P = n // 16
    buf_lo = torch.randn(3, P * 2, 64, generator=gen); buf_hi = buf_lo + 1
    lo, hi = buf_lo[:, :P], buf_hi[:, :P]
    q = torch.randn(9, 64, generator=gen).view(3, 3, 64)
    fs = {"before": before, "gemv": gemv, "mv": mv, "bmm_row": bmm_row, "mulsum": mulsum}
    ref = before(lo, hi, q)
    for k, f in fs.items(): assert torch.allclose(f(lo, hi, q), ref, rtol=1e-4, atol=1e-3), k
    t = {k: [] for k in fs}
    for _ in range(20):
        for name, f in fs.items():
            s = time.perf_counter()
            for _ in range(100): f(lo, hi, q)
            t[name].append((time.perf_counter() - s) * 1e4)
    print(n, {k: round(statistics.median(v), 1) for k, v in t.items()}, "µs per bound")
