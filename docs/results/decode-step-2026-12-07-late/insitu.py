"""In-situ time of InfiniGen's parts inside real 2K decode steps (one thread): each part wrapped by a timer while
`bench decode-step` runs dense and InfiniGen interleaved.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/decode-step-2026-12-07-late/insitu.py [context]
"""
import sys, time, torch, collections
torch.set_num_threads(1)
import tools.bench.decode_step as ds
from shared.compute import selective, floor as F
from shared.compute.selectors.infinigen import InfiniGenSelector
acc = collections.defaultdict(float); cnt = collections.defaultdict(int)
def wrap(obj, name, label):
    real = getattr(obj, name)
    def timed(*a, **k):
        s = time.perf_counter(); r = real(*a, **k); acc[label] += time.perf_counter() - s; cnt[label] += 1; return r
    setattr(obj, name, timed)
wrap(selective, "speculated_query", "speculated_query")
wrap(selective, "select_with_floor", "select_with_floor")
wrap(InfiniGenSelector, "extend", "extend")
wrap(InfiniGenSelector, "_scores", "_scores")
ds.run(context=int(sys.argv[1]) if len(sys.argv) > 1 else 2048, budget=0.1, steps=22, threads=[1], selectors=["infinigen"])
for k in acc:
    print(f"{k:20s} {acc[k] / cnt[k] * 1e6:8.1f} µs a call, {cnt[k]} calls, {acc[k] * 1e3 / (cnt['extend'] / 28):7.2f} ms a step")
