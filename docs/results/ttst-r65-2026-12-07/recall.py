"""How much of decode step 1's selection a push chosen at the prefill can carry: the share of step 1's selected
prompt entries (layers ≥ 2) among the top scores of the last m prompt positions' queries (each position's token
scores standardised per KV head, then summed over the m), at the size of step 1's selection, the sinks and the
recent window always in. m = 1 is the query-aware push's predictor (services/prefill/pushes.py).

    OMP_WAIT_POLICY=PASSIVE python docs/results/ttst-r65-2026-12-07/recall.py hata 0.2 2048 3

Arguments: a token-ranking selector (hata, infinigen), its budget, the prompt tokens, the documents."""
import sys, numpy as np, torch
from transformers import AutoTokenizer
from schemas import DEFAULT_FLOOR, Sampling
from shared.compute import selective, queries
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import DENSE_LAYERS, default_prep_dir
from shared.runtime.models import resolve_model
from tools.workloads import stdlib_files
sel_name = sys.argv[1]; budget = float(sys.argv[2]); n_tok = int(sys.argv[3])
path = resolve_model(""); runner = ModelRunner(path)
tok = AutoTokenizer.from_pretrained(path)
files = stdlib_files(40_000)
store = KvStore.with_capacity_mb(runner.kv_layout(16, "bfloat16"), 1024)
engine = DecodeEngine(runner, store, default_prep_dir(path))
M = (1, 2, 4, 8, 16)
res = {m: [0, 0] for m in M}
for doc in range(int(sys.argv[4]) if len(sys.argv) > 4 else 2):
    text = "\n".join(p.read_text(errors="replace") for p in files[3 * doc: 3 * doc + 3])
    ids = tok(text)["input_ids"][:n_tok]
    qs = {}
    hooks = []
    for i, layer in enumerate(runner.model.get_decoder().layers):
        def keep(_m, args, kwargs, i=i, layer=layer):
            h = args[0] if args else kwargs["hidden_states"]
            if h.shape[1] > 1:
                cos, sin = kwargs["position_embeddings"]
                n = h.shape[1]  # the query of position n - j, for j = 1 … max(M)
                qs[i] = [queries.query_of(layer, h[:, n - j:n - j + 1], cos[:, n - j:n - j + 1], sin[:, n - j:n - j + 1])
                         for j in range(1, max(M) + 1)]
        hooks.append(layer.register_forward_pre_hook(keep, with_kwargs=True))
    rid = f"r{doc}"
    first = engine.prefill_local(rid, ids, Sampling())
    for h in hooks: h.remove()
    engine.use_selection(rid, sel_name, budget)
    sel = engine.selections[rid].selector
    step1 = {}
    orig = selective.select_with_floor
    def spy(*a, **kw):
        idx = orig(*a, **kw); step1[a[1]] = idx.cpu().numpy(); return idx
    selective.select_with_floor = spy
    try:
        engine.step(rid, first, Sampling(), 1)
    finally:
        selective.select_with_floor = orig
    n = len(ids)
    for layer in range(DENSE_LAYERS, runner.num_layers):
        state = engine.selections[rid].states[layer]
        chosen = step1[layer]; k = chosen.shape[1]
        for m in M:
            scores = None
            for q in qs[layer][:m]:
                s = sel.token_scores(layer, state, q, n)
                if s is None:
                    raise SystemExit("token-ranking selectors only")
                sc = s[0][:, :n].float()
                sc = (sc - sc.mean(1, keepdim=True)) / (sc.std(1, keepdim=True) + 1e-6)
                scores = sc if scores is None else scores + sc
            # same pushed size as the floor selection: k picks per head incl. floor (sinks+recent always)
            mask = torch.zeros(scores.shape[0], n, dtype=torch.bool)
            mask[:, :DEFAULT_FLOOR.sinks] = True; mask[:, n - DEFAULT_FLOOR.recent:] = True
            scores[mask] = float("inf")
            top = torch.topk(scores, min(k, n), dim=1).indices.numpy()
            pushed = np.zeros((scores.shape[0], n), dtype=bool); np.put_along_axis(pushed, top, True, axis=1)
            inp = chosen < n
            res[m][0] += int(np.take_along_axis(pushed, np.minimum(chosen, n - 1), axis=1)[inp].sum()); res[m][1] += int(inp.sum())
    engine.end(rid); store.free(rid)
    print(doc, {m: round(res[m][0] / res[m][1], 3) for m in M}, flush=True)
