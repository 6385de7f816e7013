"""`smartgen bench conversation`: a multi-turn chat in full mode, served twice, by a stack with the decode workers'
prefix cache on and by one with it off (docs/operations.md, "The prefix cache"). Turn 1 asks about a long document;
each later turn sends every turn before it, the answers included, and one new question. Per turn: the prompt, the
tokens the decode worker had cached, the KV bytes moved, TTFT, TTST and the decode's wait for the KV, and whether
the tokens of both stacks are equal.

    smartgen bench conversation [--turns 4] [--document-lines 60] [--max-tokens 32] [--link-gbps 0.5] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tools.args import add_json, add_model
from tools.client import post_json
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack

QUESTIONS = ["What does the chronicle say about the keeper?", "Which years were the busiest?",
             "What about the storms?", "Summarize it in one sentence.", "Who were the captains?",
             "What changed over the years?"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `conversation` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("conversation", help="a multi-turn chat, decode prefix cache on vs off")
    add_json(bench)
    bench.add_argument("--turns", type=int, default=4, help=f"turns of the chat (1..{len(QUESTIONS)})")
    bench.add_argument("--document-lines", type=int, default=60, help="lines of the document in turn 1 (~43 tokens each)")
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer")
    bench.add_argument("--link-gbps", type=float, default=0.5, help="every data-plane link paced to this (0 = unpaced)")
    add_model(bench)
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    if not 1 <= args.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns takes 1..{len(QUESTIONS)}, not {args.turns}")
    rows = run(args.model, args.turns, args.document_lines, args.max_tokens, args.link_gbps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print("| turn | prompt | decode cached | moved on / off (MB) | TTFT on / off (s) | TTST on / off (s) | "
          "KV wait on / off (s) | tokens equal |\n|---|---|---|---|---|---|---|---|")
    for row in rows:
        on, off = row["on"], row["off"]
        print(f"| {row['turn']} | {on['prompt_tokens']} | {on['decode_cached_tokens']} | {on['kv_mb']} / {off['kv_mb']} | "
              f"{on['ttft_s']} / {off['ttft_s']} | {on['ttst_s']} / {off['ttst_s']} | {on['kv_wait_s']} / "
              f"{off['kv_wait_s']} | {row['tokens_equal']} |")


def run(model: str, turns: int, document_lines: int, max_tokens: int, link_gbps: float) -> list[dict]:
    """Per turn: {"turn", "on", "off", "tokens_equal"}, "on"/"off" being that turn's figures on each stack."""
    document = "\n".join(f"In year {1800 + i} the harbour of the northern cape saw {i * 7 % 53} ships, and the keeper "
                         f"wrote of storm number {i * 3 % 17} in her ledger." for i in range(document_lines))
    questions = [f"Here is a chronicle:\n{document}\n\n{QUESTIONS[0]}", *QUESTIONS[1:turns]]
    on = _chat(model, questions, max_tokens, link_gbps, {})
    off = _chat(model, questions, max_tokens, link_gbps, {"SMARTGEN_DECODE_PREFIX_CACHE_MB": "0"})
    return [{"turn": k + 1, "on": a, "off": b, "tokens_equal": a.pop("token_ids") == b.pop("token_ids")}
            for k, (a, b) in enumerate(zip(on, off))]


def _chat(model: str, questions: list[str], max_tokens: int, link_gbps: float, env: dict[str, str]) -> list[dict]:
    """The chat on a fresh stack (full mode, greedy) with `env`; per turn its figures and token ids."""
    logs = Path(tempfile.mkdtemp(prefix="smartgen-conversation-"))
    spec = StackSpec(model=model, gateway_port=free_port(), log_file=logs / "stack.log",
                     env={"SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_LINK_GBPS": str(link_gbps), **env})
    rows, messages = [], []
    with started_stack(spec, 600) as stack:
        for question in questions:
            messages.append({"role": "user", "content": question})
            status, body = post_json(stack.gateway_url + "/v1/chat/completions",
                                     {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                      "transfer_mode": "full"}, timeout=1800)
            if status != 200:
                raise SystemExit(f"bench conversation: the chat failed ({status}): {body}")
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            sg = body["smartgen"]
            rows.append({"prompt_tokens": body["usage"]["prompt_tokens"], "decode_cached_tokens": sg["decode_cached_tokens"],
                         "kv_mb": round(sg["kv_bytes"].get("full", 0) / 1e6, 3), "ttft_s": round(sg["ttft_s"], 3),
                         "ttst_s": round(sg["ttst_s"], 3), "kv_wait_s": round(sg["kv_wait_s"], 3),
                         "token_ids": sg["token_ids"]})
    return rows
