"""The selection's memory (schemas BudgetFloor.stick) against its cost: for each stick, the union of a request's
selections over 64 decode steps (what a slow link must carry after the push) and the KL to dense attention.

Teacher-forced as `smartgen eval fidelity` (documents that calibration never saw, the true continuation fed, the
decode worker's floor), all KV local; the union counts the prompt entries (layer, KV head, token) that step 1 and
the later steps selected, as `smartgen eval drift` replays them, and prices them as K8V8 records (the default push).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/sticky-selection/sweep.py --prompt-tokens 2048 --docs 4 \
        --selector hata --budget 0.2 --sticks 0,0.25,0.5,0.75,1
"""
import argparse
import copy
import dataclasses
import json
import time

import torch
from transformers import AutoTokenizer

from schemas import DEFAULT_FLOOR
from shared.compute import selective
from shared.compute.decode_engine import DecodeEngine
from schemas import entry_record_bytes
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.quantization import QuantLayout
from shared.compute.selectors import default_prep_dir
from shared.runtime.models import resolve_model
from tools import workloads
from tools.eval.fidelity import _teacher_forced

TOKENS = 64


def quantized_copy(cache, bits: int):
    """A copy of the prefill's cache whose every layer went through the quantized mode's codes (QuantLayout)."""
    out = copy.deepcopy(cache)
    for layer in out.layers:
        keys, values = layer.keys[0], layer.values[0]  # (H_kv, n, d)
        q = QuantLayout(1, keys.shape[0], keys.shape[2], keys.shape[1], bits)
        aux = torch.zeros(q.nbytes, dtype=torch.uint8)
        q.quantize(aux, 0, keys, values)
        q.dequantize(aux, 0, keys, values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--selector", default="hata")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--sticks", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--quantized-bits", type=int, default=0,
                    help="also the `quantized` peer at these bits: every entry through its codes, dense decoding")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    sticks = [float(x) for x in args.sticks.split(",")]
    path = resolve_model("")
    runner = ModelRunner(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    layout = runner.kv_layout(16)
    entry = entry_record_bytes(layout.head_dim, 8)  # one K8V8 record: one token of one KV head's K and V
    engine = DecodeEngine(runner, KvStore(layout, 1), default_prep_dir(path))
    docs = []
    for name, text in workloads.evaluation_documents(4 * args.docs, min_chars=4 * (args.prompt_tokens + TOKENS)):
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= args.prompt_tokens + TOKENS and len(docs) < args.docs:
            docs.append((name, ids))
    acc = {s: {"kl": [], "agree": [], "step1": 0, "union": 0} for s in sticks}
    peer = {"kl": [], "agree": []}
    select = selective.select_with_floor
    started = time.monotonic()
    for name, ids in docs:
        prompt, continuation = ids[:args.prompt_tokens], ids[args.prompt_tokens:args.prompt_tokens + TOKENS]
        logits, cache = runner.prefill(prompt)
        first = torch.log_softmax(logits.float(), -1)
        engine.caches["dense"] = copy.deepcopy(cache)
        dense = torch.cat([first[None], _teacher_forced(engine, "dense", continuation[:-1])])
        engine.end("dense")
        if args.quantized_bits:  # the quantized peer on the same positions: its codes' values, every token attended
            engine.caches["q"] = quantized_copy(cache, args.quantized_bits)
            q = torch.cat([first[None], _teacher_forced(engine, "q", continuation[:-1])])
            engine.end("q")
            peer["kl"] += (dense.exp() * (dense - q)).sum(-1)[1:].tolist()
            peer["agree"] += (dense.argmax(-1) == q.argmax(-1))[1:].float().tolist()
        for stick in sticks:
            engine.floor = dataclasses.replace(DEFAULT_FLOOR, stick=stick)
            union: dict[int, torch.Tensor] = {}  # layer → (kv, prompt tokens) bool

            def recording(selector_, layer, state, probe, k, n, floor):
                idx = select(selector_, layer, state, probe, k, n, floor)
                seen = union.get(layer)
                if seen is None:
                    seen = union[layer] = torch.zeros(idx.shape[0], len(prompt) + 1, dtype=torch.bool)
                    acc[stick]["step1"] += int((idx < len(prompt)).sum())
                seen.scatter_(1, idx.clamp(max=len(prompt)), True)
                return idx

            selective.select_with_floor = recording
            try:
                engine.caches["sel"] = copy.deepcopy(cache)
                engine.use_selection("sel", args.selector, args.budget)
                sel = torch.cat([first[None], _teacher_forced(engine, "sel", continuation[:-1])])
                engine.end("sel")
            finally:
                selective.select_with_floor = select
            a = acc[stick]
            a["kl"] += (dense.exp() * (dense - sel)).sum(-1)[1:].tolist()
            a["agree"] += (dense.argmax(-1) == sel.argmax(-1))[1:].float().tolist()
            a["union"] += sum(int(u[:, :-1].sum()) for u in union.values())
        print(f"# {name}: {time.monotonic() - started:.0f} s", flush=True)
    entries = sum(min(len(ids), args.prompt_tokens) for _, ids in docs) * (layout.num_layers - 2) * layout.num_kv_heads
    rows = []
    for stick in sticks:
        a = acc[stick]
        rows.append({"selector": args.selector, "budget": args.budget, "prompt_tokens": args.prompt_tokens,
                     "docs": len(docs), "stick": stick, "kl_mean": sum(a["kl"]) / len(a["kl"]),
                     "greedy_agreement": sum(a["agree"]) / len(a["agree"]), "step1_share": a["step1"] / entries,
                     "union_share": a["union"] / entries, "union_mb_per_doc": a["union"] * entry / 1e6 / len(docs)})
        print(json.dumps(rows[-1]), flush=True)
    if peer["kl"]:
        rows.append({"quantized_bits": args.quantized_bits, "prompt_tokens": args.prompt_tokens, "docs": len(docs),
                     "kl_mean": sum(peer["kl"]) / len(peer["kl"]),
                     "greedy_agreement": sum(peer["agree"]) / len(peer["agree"])})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
