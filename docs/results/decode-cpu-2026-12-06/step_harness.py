"""Torch-thread CPU per decode step, in one process, steps interleaved: colocated-selective (A) against a remote view
(B: path 3's ranking off, C: on) whose reads complete at once on an event-loop thread (a stub data plane; 30% of the
prompt's pages not pushed, so a step reads): what the remote path itself costs the torch thread, nothing else
running. HATA at 20%, a 2K document, SmolLM2, one torch thread. PROF=C also prints cProfile's tottime, C minus A.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/decode-cpu-2026-12-06/step_harness.py
"""
import asyncio, os, statistics, threading, time, cProfile, pstats
import numpy as np, torch
from transformers import AutoTokenizer
from schemas import KvSource, Sampling
from services.decode.remote import RemoteKv
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import default_prep_dir
from shared.runtime.models import resolve_model
from tools import workloads
torch.set_num_threads(1)
STEPS = int(os.environ.get("STEPS", 24)); PROF = os.environ.get("PROF", "")
path = resolve_model(""); runner = ModelRunner(path); tok = AutoTokenizer.from_pretrained(path)
layout = runner.kv_layout(16, "bfloat16"); store = KvStore(layout, 600)
engine = DecodeEngine(runner, store, default_prep_dir(path))
ids = tok(workloads.evaluation_documents(2, min_chars=12000)[0][1])["input_ids"][:2048]
loop = asyncio.new_event_loop(); threading.Thread(target=loop.run_forever, daemon=True).start()
class StubPlane:
    async def read(self, *a, **k): await asyncio.sleep(0)
    async def read_gather(self, *a, **k): await asyncio.sleep(0)
rng = np.random.default_rng(0)
g = Sampling(); tokens = {}; remotes = {}
for rid, ranked in (("A", None), ("B", False), ("C", True)):
    tokens[rid] = engine.prefill_local(rid, ids, g, max_new_tokens=STEPS + 8)
    if ranked is None:
        engine.use_selection(rid, "hata", 0.2); continue
    pages = (len(ids) + 15) // 16
    pushed = rng.random((layout.num_layers, pages)) < 0.7
    pushed[:2] = True
    slab = store.slab(rid)
    r = RemoteKv(StubPlane(), loop, KvSource("p", "x:1", 1, 0, slab.capacity, 60.0), layout, store.offset(slab),
                 slab.capacity, len(ids), pushed, ranked=ranked, speculative=False)
    remotes[rid] = r
    engine.use_selection(rid, "hata", 0.2, remote=r)
cpu = {r: [] for r in tokens}; wall = {r: [] for r in tokens}
profs = {r: cProfile.Profile() for r in tokens} if PROF else {}
for _ in range(STEPS):
    for rid in tokens:
        if profs: profs[rid].enable()
        c0, w0 = time.thread_time(), time.perf_counter()
        tokens[rid] = int(engine.step_logits(rid, tokens[rid]).argmax())
        cpu[rid].append(time.thread_time() - c0); wall[rid].append(time.perf_counter() - w0)
        if profs: profs[rid].disable()
for rid in tokens:
    extra = f" fetches {remotes[rid].num_fetch_reads} queue {len(remotes[rid].ranked_queue)} missing {remotes[rid].num_missing}" if rid in remotes else ""
    print(f"{rid}: cpu median {1e3*statistics.median(cpu[rid][2:]):.1f} ms, wall {1e3*statistics.median(wall[rid][2:]):.1f} ms{extra}")
if profs:
    stats = {r: pstats.Stats(p).stats for r, p in profs.items()}
    def per(r):
        out = {}
        for (f, line, name), (cc, nc, tt, ct, callers) in stats[r].items():
            out[f"{f.split('/')[-1]}:{name}"] = out.get(f"{f.split('/')[-1]}:{name}", 0) + tt
        return out
    a, other = per("A"), per(PROF)
    diff = sorted(((other.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(other)), reverse=True)
    print(f"tottime {PROF} - A per step (ms):")
    for d, k in diff[:22]:
        print(f"  {1e3 * d / STEPS:7.2f}  {k}")
    print(f"  total {1e3 * (sum(other.values()) - sum(a.values())) / STEPS:.2f}")
