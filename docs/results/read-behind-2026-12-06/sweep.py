"""A step that does not stall (a request ablating "stall", services/decode/read_behind.py) against one that does:
the KL to dense attention when a layer's picks that are not on the decode node are replaced by its best local
entries and arrive `delay` steps later, and the quantized peer on the same positions.

Teacher-forced as sticky-selection/sweep.py (documents that calibration never saw, the true continuation fed, the
decode worker's floor and memory). The decode node's presence is simulated through the real code path: a stand-in
for the remote view (`SimulatedLink`, the RemoteEntries protocol) says what is local, and selective attention asks it
exactly as it asks RemoteKv. What is local at first is step 1's selection (the push brings it: the slow-link case,
nothing else pushed, no background path); a pick that was not local becomes local `delay` steps after the step that
wanted it (delay 0: a step that waits, i.e. today's exact decoding).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/read-behind-2026-12-06/sweep.py --prompt-tokens 2048 \
        --docs 4 --configs 0.2:0.25,0.3:1 --delays 0,1,2 --quantized-bits 4
"""
import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sticky-selection"))
from sweep import TOKENS, quantized_copy  # noqa: E402 (the sibling run's helpers)

from schemas import DEFAULT_FLOOR  # noqa: E402
from services.decode.read_behind import ReadBehind  # noqa: E402
from shared.compute.decode_engine import DecodeEngine  # noqa: E402
from shared.compute.kvstore import KvStore  # noqa: E402
from shared.compute.modeling import ModelRunner  # noqa: E402
from shared.compute.selectors import default_prep_dir  # noqa: E402
from shared.runtime.models import resolve_model  # noqa: E402
from tools import workloads  # noqa: E402
from tools.eval.fidelity import _teacher_forced  # noqa: E402


class SimulatedLink:
    """The remote view as selective attention sees it, over a link that brings a missed pick `delay` steps later.
    Every value is really in the cache (nothing is read); only what counts as local is simulated, with the
    decode service's own ReadBehind rule (its reads replaced by a delivery queue)."""

    parallel = True

    def __init__(self, num_layers: int, num_kv_heads: int, num_tokens: int, delay: int):
        self.delay, self.step = delay, 0
        self.step_wait: list[float] = []  # ReadBehind reads it: empty during step 1
        present = np.zeros((num_layers, num_kv_heads, num_tokens), dtype=bool)
        self.presence = type("P", (), {})()
        self.presence.present = present
        self.presence.missing_per_layer = np.full(num_layers, num_kv_heads * num_tokens)
        self.presence.remote_part = self._remote_part
        self.behind = ReadBehind(self)
        self.due: list[tuple[int, int, list[tuple[int, np.ndarray]]]] = []  # (step, layer, heads)
        self.num_tokens, self.missed = num_tokens, 0

    def _remote_part(self, layer, idx):
        idx_np = idx.numpy()
        in_prompt = idx_np < self.num_tokens
        rows = np.broadcast_to(np.arange(idx_np.shape[0])[:, None], idx_np.shape)
        remote = np.zeros(idx_np.shape, dtype=bool)
        remote[in_prompt] = ~self.presence.present[layer][rows[in_prompt], idx_np[in_prompt]]
        return remote, [(h, idx_np[h][remote[h]]) for h in range(idx_np.shape[0]) if remote[h].any()]

    def start_read(self, layer, heads):  # ReadBehind's read: delivered `delay` steps from now
        self.due.append((self.step + self.delay, layer, heads))
        done = __import__("concurrent.futures").futures.Future()
        done.set_result(None)
        return done

    def begin_step(self):
        keep = []
        for step, layer, heads in self.due:
            if step <= self.step:
                for h, tokens in heads:
                    self.presence.present[layer, h, tokens] = True
            else:
                keep.append((step, layer, heads))
        self.due = keep
        self.presence.missing_per_layer = (~self.presence.present).sum(axis=(1, 2))

    def end_step(self):
        self.step += 1
        self.step_wait.append(0.0)

    def ready(self, layer):
        pass

    def is_ready(self, layer):
        return True

    def fetch(self, layer, idx):
        if idx is not None and self.step == 0:  # step 1 waits: the push brings its selection
            for h in range(idx.shape[0]):
                tokens = idx[h][idx[h] < self.num_tokens].numpy()
                self.presence.present[layer, h, tokens] = True
        elif idx is not None and self.delay == 0:  # a step that waits: every pick is read before attention
            remote, heads = self._remote_part(layer, idx)
            self.missed += int(remote.sum())
            for h, tokens in heads:
                self.presence.present[layer, h, tokens] = True
        elif idx is not None:
            remote, _ = self._remote_part(layer, idx)
            self.missed += int(remote.sum())  # picked where too few were local: a wait would remain here
        return None

    def read_behind(self, layer, idx):
        return self.behind.absent_if_missed(layer, idx) if self.delay else None

    def wants_speculation(self, layer):
        return False

    def wants_ranking(self, layer):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--selector", default="hata")
    ap.add_argument("--configs", default="0.2:0.25", help="budget:stick pairs, comma-separated (the default: 20%%, 0.25)")
    ap.add_argument("--delays", default="0,1,2,4")
    ap.add_argument("--quantized-bits", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    delays = [int(x) for x in args.delays.split(",")]
    configs = [(float(b), float(s)) for b, s in (c.split(":") for c in args.configs.split(","))]
    runs = [(b, s, d) for b, s in configs for d in delays]
    path = resolve_model("")
    runner = ModelRunner(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    layout = runner.kv_layout(16)
    engine = DecodeEngine(runner, KvStore(layout, 1), default_prep_dir(path))
    docs = []
    for name, text in workloads.evaluation_documents(4 * args.docs, min_chars=4 * (args.prompt_tokens + TOKENS)):
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= args.prompt_tokens + TOKENS and len(docs) < args.docs:
            docs.append((name, ids))
    acc = {r: {"kl": [], "agree": [], "substituted": 0, "waited": 0, "selected": 0} for r in runs}
    peer = {"kl": [], "agree": []}
    started = time.monotonic()
    for name, ids in docs:
        prompt, continuation = ids[:args.prompt_tokens], ids[args.prompt_tokens:args.prompt_tokens + TOKENS]
        logits, cache = runner.prefill(prompt)
        first = torch.log_softmax(logits.float(), -1)
        engine.caches["dense"] = copy.deepcopy(cache)
        dense = torch.cat([first[None], _teacher_forced(engine, "dense", continuation[:-1])])
        engine.end("dense")
        if args.quantized_bits:
            engine.caches["q"] = quantized_copy(cache, args.quantized_bits)
            q = torch.cat([first[None], _teacher_forced(engine, "q", continuation[:-1])])
            engine.end("q")
            peer["kl"] += (dense.exp() * (dense - q)).sum(-1)[1:].tolist()
            peer["agree"] += (dense.argmax(-1) == q.argmax(-1))[1:].float().tolist()
        for budget, stick, delay in runs:
            engine.floor = dataclasses.replace(DEFAULT_FLOOR, stick=stick)
            link = SimulatedLink(layout.num_layers, layout.num_kv_heads, len(prompt), delay)
            engine.caches["sel"] = copy.deepcopy(cache)
            engine.use_selection("sel", args.selector, budget, remote=link)
            sel = torch.cat([first[None], _teacher_forced(engine, "sel", continuation[:-1])])
            engine.end("sel")
            a = acc[budget, stick, delay]
            a["kl"] += (dense.exp() * (dense - sel)).sum(-1)[1:].tolist()
            a["agree"] += (dense.argmax(-1) == sel.argmax(-1))[1:].float().tolist()
            a["substituted"] += link.behind.num_substituted
            a["waited"] += link.missed
            a["selected"] += (TOKENS - 2) * (layout.num_layers - 2) * layout.num_kv_heads * round(budget * len(prompt))
        print(f"# {name}: {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    for budget, stick, delay in runs:
        a = acc[budget, stick, delay]
        rows.append({"selector": args.selector, "budget": budget, "stick": stick, "prompt_tokens": args.prompt_tokens,
                     "docs": len(docs), "delay_steps": delay, "kl_mean": sum(a["kl"]) / len(a["kl"]),
                     "greedy_agreement": sum(a["agree"]) / len(a["agree"]),
                     "substituted_share": a["substituted"] / a["selected"], "waited_share": a["waited"] / a["selected"]})
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
