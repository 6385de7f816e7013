"""InfiniGen's partial keys kept in fp32 (before) against rounded to the KV's dtype, bf16 (now): the same requests
decoded all-local (colocated-selective, InfiniGen 20%, the served floor) side by side, step by step; per step and
layer, the overlap of the two selections (|A ∩ B| / |A ∪ B| over (KV head, token) entries), the greedy tokens,
and each one's KL from dense attention (a dense copy of the request steps beside them; all three are fed the dense
copy's greedy tokens, so the contexts stay equal).

    OMP_WAIT_POLICY=PASSIVE python docs/results/infinigen-bf16-metadata-2026-12-07/selections.py [PROMPTS] [TOKENS] [STEPS]

Every request's KV is a copy of one prefill of its prompt (the KV store in bf16, as served); "before" swaps in
the extend of 4d6a1ba's InfiniGen (no rounding) for its own steps."""
import statistics
import sys

import torch
from transformers import AutoTokenizer

from schemas import Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import default_prep_dir
from shared.compute.selectors.infinigen import InfiniGenSelector
from shared.runtime.models import resolve_model
from tools.bench.decode_batch import _copy_request
from tools.workloads import stdlib_files

prompts, ctx, steps = (int(a) for a in (sys.argv[1:4] + ["3", "2048", "32"][len(sys.argv) - 1:]))
torch.set_num_threads(2)
path = resolve_model("")
runner = ModelRunner(path, "cpu", "auto")
layout = runner.kv_layout(16, "bfloat16")
store = KvStore.with_capacity_mb(layout, 4 * (ctx + steps + 20) * layout.token_bytes // 2**20 + 1)
engine = DecodeEngine(runner, store, default_prep_dir(path))
tokenizer = AutoTokenizer.from_pretrained(path)
files = stdlib_files(40_000)
rounding_extend = InfiniGenSelector.extend


def fp32_extend(self, layer, state, keys):
    """InfiniGenSelector.extend before: the partial keys as computed, fp32."""
    state.partial_keys.append(self._partial(layer, keys[:, state.num_tokens:], per_query_head=False).transpose(1, 2))
    state.num_tokens = keys.shape[1]


overlaps, same_tokens, first_diff = [], 0, []
kl: dict[str, list[float]] = {"before": [], "now": []}
for p in range(prompts):
    text = "\n".join(f.read_text(errors="replace") for f in files[3 * p: 3 * p + 3])
    ids = tokenizer(text)["input_ids"][:ctx]
    engine.prefill_local("prompt", ids, Sampling(), max_new_tokens=steps + 10)
    tokens = {}
    for name in ("dense", "before", "now"):
        _copy_request(engine, "prompt", name, len(ids), steps + 10)
        if name != "dense":
            engine.use_selection(name, "infinigen", 0.2)
            engine.selections[name].picks = {}
        tokens[name] = [ids[-1]]
    picks = {"before": [], "now": []}
    for _ in range(steps):
        fed = tokens["dense"][-1]
        dense = torch.log_softmax(engine.step_logits("dense", fed).float(), -1)
        tokens["dense"].append(int(dense.argmax()))
        for name in ("before", "now"):
            InfiniGenSelector.extend = fp32_extend if name == "before" else rounding_extend
            logits = torch.log_softmax(engine.step_logits(name, fed).float(), -1)
            kl[name].append(float((dense.exp() * (dense - logits)).sum()))
            tokens[name].append(int(logits.argmax()))
            picks[name].append({layer: idx.clone() for layer, idx in engine.selections[name].picks.items()})
    InfiniGenSelector.extend = rounding_extend
    for step_a, step_b in zip(picks["before"], picks["now"]):
        for layer in step_a:
            a = {(h, t) for h in range(step_a[layer].shape[0]) for t in step_a[layer][h].tolist()}
            b = {(h, t) for h in range(step_b[layer].shape[0]) for t in step_b[layer][h].tolist()}
            overlaps.append(len(a & b) / len(a | b))
    same = tokens["before"] == tokens["now"]
    same_tokens += same
    if not same:
        first_diff.append(next(i for i, (x, y) in enumerate(zip(tokens["before"], tokens["now"])) if x != y))
    for name in ("prompt", "dense", "before", "now"):
        engine.end(name)
        store.free(name)
    print(f"prompt {p}: {len(ids)} tokens, same greedy tokens over {steps} steps (teacher-forced): {same}")
print(f"{prompts} prompts × {steps} steps, InfiniGen 20%: selection overlap per (step, layer) median "
      f"{statistics.median(overlaps):.4f}, mean {statistics.mean(overlaps):.4f}, min {min(overlaps):.4f} "
      f"({len(overlaps)} selections); same tokens in {same_tokens} of {prompts}; mean KL vs dense: fp32 partial keys "
      f"{statistics.mean(kl['before']):.5f}, bf16 {statistics.mean(kl['now']):.5f}"
      + (f"; first difference at steps {first_diff}" if first_diff else ""))
