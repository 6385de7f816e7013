"""Op by op, self CPU per step under torch.profiler: each selector (and dense) against positional, at 2K, one thread.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/decode-step-2026-12-07-late/opdiff.py [context]
"""
import sys, time, torch
torch.set_num_threads(1)
CONTEXT = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
import tools.bench.decode_step as ds
from torch.profiler import ProfilerActivity, profile
names = ["positional", "infinigen", "hata", "quest", "dense"]
captured = {}
def fake_profile(live, one_step, steps, top=15):
    for name in live:
        for _ in range(3): one_step(name)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps): one_step(name)
        captured[name] = {e.key: (e.self_cpu_time_total / steps / 1000, e.count / steps) for e in prof.key_averages()}
    return {}
ds._profile = fake_profile
ds.run(context=CONTEXT, budget=0.1, steps=6, threads=[1], selectors=names[:4], profile=12)
base = captured["positional"]
for name in ("infinigen", "hata", "quest", "dense"):
    cur = captured[name]
    diffs = sorted(((cur.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], k, cur.get(k, (0, 0))[1] - base.get(k, (0, 0))[1]) for k in set(cur) | set(base)), reverse=True)
    tot = sum(v[0] for v in cur.values()) - sum(v[0] for v in base.values())
    print(f"== {name} − positional: {tot:+.1f} ms/step self CPU (profiled)")
    for d, k, c in diffs[:14]:
        print(f"   {d:+7.2f} ms  {c:+7.1f} calls  {k}")
