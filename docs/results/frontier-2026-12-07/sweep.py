"""What smartgen's decode phase moves, and what it costs in answer quality, if the entries it reads after step 1
(the union of the later steps' selections less what the push brought) travel in fewer bits than the push.

On `bench serve`'s own prompts (its default tasks), teacher-forced along dense's greedy answer of 64 tokens, the
decode worker's floor, all KV local. Each configuration `budget:stick:push_v:read_k:read_v[:hata_bits]` decodes with HATA:

- before step 1 every prompt entry holds its push record's values (K 8 bits, V `push_v`; 16 = exact bf16), as
  smartgen's push brings step 1's selection and the first two (dense) layers;
- its HATA codes `hata_bits` wide (optional sixth field; 128, HATA's, by default: the first bits of its trained
  projections otherwise);
- after step 1, every entry of layers ≥ 2 that step 1 did not select is replaced by a record of K `read_k`, V
  `read_v` bits (per-vector codes, as `EntryCodes`): whatever a later step picks of them arrives as such a read.

Per configuration it prints the KL to dense, top-1 agreement, the union's share of the entries of layers ≥ 2, and
the bytes a link carries by token 64: HATA's metadata + the push (dense layers + step 1's selection) + the reads
(union − step 1), against the quantized mode's codes of every entry (its CTL64 on a slow link is its bytes ÷ the
link rate plus ~64 dense steps). The push is approximated by step 1's own selection (the prefill's query-aware push
selects with the prompt's last query, then step 1 fetches what it lacks: the same bytes to within a few percent).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/frontier-2026-12-07/sweep.py --prompt-tokens 8000 \
        --requests 2 --configs 0.2:0.25:8:8:8,0.2:0.25:4:8:4,0.2:0.25:4:4:4 --json out.json
"""
import argparse
import dataclasses
import json
import time

import torch
from transformers import AutoTokenizer

from schemas import DEFAULT_FLOOR, DENSE_LAYERS
from shared.compute.entry_codes import EntryCodes
from shared.compute.modeling import ModelRunner
from shared.compute.selectors.hata import HataSelector
from shared.compute.selectors.keycodes import KeyCodesSelector
from shared.compute.quantization import QuantLayout, dequantize_partitions, quantize_partitions
from shared.runtime.models import prepare_default_model
from tools.bench.serve import BenchConfig, build_samples
from tools.eval import paired

TOKENS = 64
HATA_BITS = 128  # HATA's code per (layer ≥ 2, KV head, token), as its metadata layout packs it
SELECTOR = "hata"  # --selector: another one (keycodes, oracle…), priced with its own metadata


def record_bytes(head_dim: int, k_bits: int, v_bits: int) -> int:
    """One entry's record: K and V codes with an fp16 scale and minimum each (16 bits: the bf16 row itself)."""
    if k_bits >= 16 and v_bits >= 16:
        return 2 * head_dim * 2
    return head_dim * (k_bits + v_bits) // 8 + 2 * 2 * 2


def through_codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (m, d): the values a per-vector record of `bits` holds for it (x itself at 16 bits)."""
    if bits >= 16:
        return x
    codes, scale_min = quantize_partitions(x.float(), bits)
    return dequantize_partitions(codes, scale_min, bits).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class Config:
    budget: float
    stick: float
    push_v: int
    read_k: int
    read_v: int
    hata_bits: int = HATA_BITS

    @classmethod
    def parse(cls, text: str) -> "Config":
        b, s, pv, rk, rv, *hb = text.split(":")
        return cls(float(b), float(s), int(pv), int(rk), int(rv), *map(int, hb))

    @property
    def name(self) -> str:
        return f"{self.budget}:{self.stick}:{self.push_v}:{self.read_k}:{self.read_v}:{self.hata_bits}"

    @property
    def selector(self) -> str:
        return SELECTOR if self.hata_bits == HATA_BITS else f"hata-{self.hata_bits}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--configs", default="0.2:0.25:8:8:8,0.2:0.25:4:8:4,0.2:0.25:4:4:4")
    ap.add_argument("--selector", default="hata", help="hata, keycodes, or oracle (the best any selector could do)")
    ap.add_argument("--key-bits", type=int, default=0, help="keycodes: its codes' width (default: the selector's own)")
    ap.add_argument("--tasks", default="", help="comma-separated workloads (default: bench serve's own)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    configs = [Config.parse(c) for c in args.configs.split(",")]
    global SELECTOR
    SELECTOR = args.selector
    path = str(prepare_default_model())
    runner = ModelRunner(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = BenchConfig(modes=["smartgen"], prompt_tokens=[args.prompt_tokens], requests=args.requests)
    if args.tasks:
        cfg.tasks = args.tasks.split(",")
    prompts = [list(tokenizer(s.prompt)["input_ids"])
               for s in build_samples(tokenizer, cfg.tasks, cfg.requests, args.prompt_tokens)]
    lay = runner.kv_layout(16)
    engine = paired._engine(runner, path, max(map(len, prompts)) + TOKENS + 512, len(configs) + 2, "bfloat16")
    if args.key_bits:  # keycodes at another width, under its own name
        engine._selectors[SELECTOR] = KeyCodesSelector(engine.selector(SELECTOR).geometry, key_bits=args.key_bits)
    acc = {c.name: {"kl": [], "agree": [], "meta": 0, "push": 0, "read": 0, "entries": 0, "step1": 0, "union": 0}
           for c in configs}
    peer = {"kl": [], "agree": [], "bytes": 0}
    started = time.monotonic()
    with torch.inference_mode():
        for ids in prompts:
            n = len(ids)
            logits, cache = runner.prefill(ids)
            tokens, dense = paired._greedy(engine, cache, ids, logits, TOKENS, None, ["dense"], 0.2)["dense"]
            rids = {"q4": paired._load(engine, cache, ids, len(tokens), "quantized-4bit", 0.2)}
            for c in configs:
                engine.floor = dataclasses.replace(DEFAULT_FLOOR, stick=c.stick)
                rid = rids[c.name] = load(engine, cache, ids, len(tokens), c)
                engine.selections[rid].picks = {}
            engine.floor = DEFAULT_FLOOR
            names = list(rids)
            rows = {name: [torch.zeros(runner.config.vocab_size)] for name in names}
            union = {c.name: {} for c in configs}  # layer → (H_kv, n) bool
            step1_count: dict[str, int] = {}
            for i, token in enumerate(tokens[:-1]):
                results = engine.step_batch([(rids[name], token) for name in names])
                for name, out in zip(names, results):
                    if isinstance(out, Exception):
                        raise out
                    rows[name].append(torch.log_softmax(out.float(), -1))
                for c in configs:
                    sel = engine.selections[rids[c.name]]
                    for layer, idx in sel.picks.items():
                        seen = union[c.name].setdefault(layer, torch.zeros(idx.shape[0], n + 1, dtype=torch.bool))
                        seen.scatter_(1, idx.cpu().clamp(max=n), True)
                    sel.picks = {}
                    if i == 0:  # step 1 ran on push records; what it did not select arrives later as reads
                        step1 = {layer: u[:, :n].clone() for layer, u in union[c.name].items()}
                        step1_count[c.name] = sum(int(s.sum()) for s in step1.values())
                        replace_unpicked(engine, rids[c.name], cache, step1, n, c)
            for c in configs:
                a = acc[c.name]
                forced = torch.stack(rows[c.name])
                kl, agree = paired._kl_and_agreement(dense, forced)
                a.setdefault("kl_per_prompt", []).append(sum(kl) / len(kl))
                a["kl"] += kl
                a["agree"] += agree
                union_n = sum(int(u[:, :n].sum()) for u in union[c.name].values())
                entries = (lay.num_layers - DENSE_LAYERS) * lay.num_kv_heads * n
                a["union"] += union_n
                a["step1"] += step1_count[c.name]
                a["entries"] += entries
                a["meta"] += entries * meta_per_entry(engine, c)
                pushed = DENSE_LAYERS * lay.num_kv_heads * n + step1_count[c.name]
                a["push"] += pushed * record_bytes(lay.head_dim, 8, c.push_v)
                a["read"] += (union_n - step1_count[c.name]) * record_bytes(lay.head_dim, c.read_k, c.read_v)
            kl, agree = paired._kl_and_agreement(dense, torch.stack(rows["q4"]))
            peer.setdefault("kl_per_prompt", []).append(sum(kl) / len(kl))
            peer["kl"] += kl
            peer["agree"] += agree
            peer["bytes"] += QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, n, 4).nbytes
            for rid in rids.values():
                paired._finish(engine, rid)
            print(f"# prompt of {n} tokens done at {time.monotonic() - started:.0f} s", flush=True)
    out = [{"config": "quantized-4bit", "kl_mean": sum(peer["kl"]) / len(peer["kl"]),
            "agreement_mean": sum(peer["agree"]) / len(peer["agree"]), "mb_per_prompt": peer["bytes"] / 1e6 / len(prompts),
            "bytes_vs_quantized_4bit": 1.0, "kl_per_prompt": peer["kl_per_prompt"]}]
    for c in configs:
        a = acc[c.name]
        total = a["meta"] + a["push"] + a["read"]
        out.append({"config": c.name, **dataclasses.asdict(c), "kl_mean": sum(a["kl"]) / len(a["kl"]),
                    "agreement_mean": sum(map(float, a["agree"])) / len(a["agree"]),
                    "step1_share": a["step1"] / a["entries"], "union_share": a["union"] / a["entries"],
                    "mb_per_prompt": {"metadata": a["meta"] / 1e6 / len(prompts), "push": a["push"] / 1e6 / len(prompts),
                                      "reads": a["read"] / 1e6 / len(prompts), "total": total / 1e6 / len(prompts)},
                    "bytes_vs_quantized_4bit": total / peer["bytes"], "kl_per_prompt": a["kl_per_prompt"]})
    for row in out:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tasks": cfg.tasks[:len(prompts)], "prompt_tokens": [len(p) for p in prompts], "rows": out}, f,
                      indent=1)


def load(engine, cache, ids: list[int], max_new: int, c: Config) -> str:
    """A fresh copy of the prompt's KV as configuration `c`'s push records hold it, under a request id of the
    configuration's own; returns the id."""
    if c.hata_bits != HATA_BITS and c.selector not in engine._selectors:  # HATA on the first `hata_bits` of its trained projections
        base = engine.selector("hata")
        engine._selectors[c.selector] = HataSelector(
            base.geometry, {layer: w[:, :c.hata_bits] for layer, w in base.weights.items()}, num_bits=c.hata_bits)
    name = c.selector + (f"{paired.CODES}{c.push_v}" if c.push_v < 16 else "")
    return paired._load(engine, cache, ids, max_new, name, c.budget, rid=f"sweep-{c.name}")


def meta_per_entry(engine, c: Config) -> float:
    """Bytes of selector metadata per (layer ≥ 2, KV head, token): HATA's codes at `hata_bits`, the selector's own
    layout otherwise."""
    lay = engine.store.layout
    if c.selector.startswith("hata"):
        return c.hata_bits / 8
    return engine.selector(c.selector).metadata_bytes_per_token() / lay.num_kv_heads


def replace_unpicked(engine, rid: str, cache, step1: dict[int, torch.Tensor], n: int, c: Config) -> None:
    """Every prompt entry of layers ≥ 2 that step 1 did not pick: the values of a read record (K read_k, V read_v)
    of the exact KV (rounded to the store's dtype, as the prefill encodes it)."""
    for layer, rows in enumerate(engine.caches[rid].layers):
        if layer < DENSE_LAYERS:
            continue
        absent = ~step1[layer]  # (H_kv, n)
        exact_k = cache.layers[layer].keys[0].to(rows.k_rows.dtype)  # (H_kv, n, d)
        exact_v = cache.layers[layer].values[0].to(rows.v_rows.dtype)
        keys, values = rows.k_rows[:, :n], rows.v_rows[:, :n]
        keys[absent] = through_codes(exact_k[absent], c.read_k).to(keys.device)
        values[absent] = through_codes(exact_v[absent], c.read_v).to(values.device)


if __name__ == "__main__":
    main()
