"""A/B in one process: the selective rows' attention as landed (this tree) against the row-by-row one of 02c6752
(`git worktree add /tmp/before 02c6752`; OLD_TREE to put it elsewhere), dense interleaved, step by step.

    OMP_WAIT_POLICY=PASSIVE python docs/results/decode-batch-2026-12-07/rows_together_ab.py THREADS CONTEXT BATCH SELECTOR [STEPS]

Every request's KV is a copy of one prefill of the same prompt; dense, old and new each step their own BATCH
requests, in turn, STEPS + 2 times (the first 2 are warm-up); medians. The old path runs through the old module's
`_attend_batch`, with this tree's selection code (only the attention after selection differs)."""
import os, sys, time, statistics, torch, importlib.util
from transformers import AutoTokenizer
from schemas import DEFAULT_KV_BUDGET, Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import default_prep_dir
from shared.runtime.models import resolve_model
from tools.workloads import stdlib_files
from tools.bench.decode_batch import _copy_request
import shared.compute.selective as S
spec=importlib.util.spec_from_file_location("old_selective",os.path.join(os.environ.get("OLD_TREE", "/tmp/before"), "shared/compute/selective.py"))
old=importlib.util.module_from_spec(spec); sys.modules["old_selective"]=old; spec.loader.exec_module(old)
def scratch(self, which, like, rows):
    if not hasattr(self,"_scratch_old"): self._scratch_old={}
    buf=self._scratch_old.get(which)
    if buf is None or buf.shape[0] < rows or buf.dtype != like.dtype:
        buf=self._scratch_old[which]=like.new_empty(rows + 64 * like.shape[0], like.shape[-1])
    return buf
S.Selection.scratch=scratch
import os
new_batch=S._attend_batch if not os.environ.get("AA") else None
def old_batch(*a):
    old.STEP=S.STEP
    return old._attend_batch(*a)
threads=int(sys.argv[1]); ctx=int(sys.argv[2]); B=int(sys.argv[3]); sel=sys.argv[4]; steps=int(sys.argv[5]) if len(sys.argv)>5 else 16
torch.set_num_threads(threads)
path=resolve_model("")
runner=ModelRunner(path,"cpu","auto")
layout=runner.kv_layout(16,"bfloat16")
store=KvStore.with_capacity_mb(layout,(3*B+2)*(ctx+3*steps+20)*layout.token_bytes//2**20+1)
engine=DecodeEngine(runner,store,default_prep_dir(path))
text="\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
ids=AutoTokenizer.from_pretrained(path)(text)["input_ids"][:ctx]
engine.prefill_local("prompt",ids,Sampling(),max_new_tokens=3*steps+10)
names=tuple(sys.argv[6].split(",")) if len(sys.argv)>6 else ("dense","old","new")
for name in names:
    for b in range(B):
        _copy_request(engine,"prompt",f"{name}{b}",len(ids),3*steps+10)
        if name!="dense": engine.use_selection(f"{name}{b}",sel,DEFAULT_KV_BUDGET)
t={n:[] for n in names}
toks={n:[] for n in names}
for i in range(steps+2):
    for name in names:
        S._attend_batch = old_batch if (name=="old" or new_batch is None) else new_batch
        s=time.perf_counter(); out=engine.step_batch([(f"{name}{b}",ids[-1]) for b in range(B)]); t[name].append(time.perf_counter()-s)
        toks[name].append([int(torch.argmax(o)) for o in out])
d=statistics.median(t["dense"][2:])
print(f"threads {threads} ctx {ctx} batch {B} {sel}: dense {d*1e3:.1f} ms, old {statistics.median(t['old'][2:])*1e3:.1f} ({statistics.median(t['old'][2:])/d:.3f}x), new {statistics.median(t['new'][2:])*1e3:.1f} ({statistics.median(t['new'][2:])/d:.3f}x); same tokens old/new: {toks['old']==toks['new']}")
