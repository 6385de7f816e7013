"""`smartgen bench conversation`: a multi-turn chat in full mode, served by a stack with the prefix caches on and by
one with them off (`--off all`: the prefill's and the decode workers'; `--off decode`: the decode workers' only),
both stacks up at once and each turn asked of one then the other, so a noisy machine slows both alike
(docs/operations.md, "The prefix cache"). Turn 1 asks about a long document; each later turn sends every turn
before it, the answers included, and one new question. `--repeats` chats run one after another, each over its own
document (nothing cached from the one before). Per turn: the prompt, the tokens the prefill and the decode worker had
cached, the KV bytes moved, TTFT, TTST and the decode's wait for the KV, and whether the tokens of both stacks are
equal; with repeats, the median TTFT and each chat's.

    smartgen bench conversation [--turns 4] [--document-lines 60] [--max-tokens 32] [--link-gbps 0.5]
                                [--off all|decode] [--repeats 1] [--model PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from tools.args import add_json, add_model
from tools.client import post_json
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack

QUESTIONS = ["What does the chronicle say about the keeper?", "Which years were the busiest?",
             "What about the storms?", "Summarize it in one sentence.", "Who were the captains?",
             "What changed over the years?"]


OFF_ENV = {"all": {"SMARTGEN_PREFIX_CACHE_MB": "0", "SMARTGEN_DECODE_PREFIX_CACHE_MB": "0"},  # no caching at all
           "decode": {"SMARTGEN_DECODE_PREFIX_CACHE_MB": "0"}}  # the prefill's prefix cache still on


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `conversation` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("conversation", help="a multi-turn chat, prefix caches on vs off")
    add_json(bench)
    bench.add_argument("--turns", type=int, default=4, help=f"turns of the chat (1..{len(QUESTIONS)})")
    bench.add_argument("--document-lines", type=int, default=60, help="lines of the document in turn 1 (~43 tokens each)")
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer")
    bench.add_argument("--link-gbps", type=float, default=0.5, help="every data-plane link paced to this (0 = unpaced)")
    bench.add_argument("--off", choices=sorted(OFF_ENV), default="all",
                       help="what the other stack turns off: all (no caching; default) or decode (its decode workers' "
                            "prefix cache only)")
    bench.add_argument("--repeats", type=int, default=1, help="chats, each over its own document (TTFT: the median)")
    add_model(bench)
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    if not 1 <= args.turns <= len(QUESTIONS) or args.repeats < 1:
        raise SystemExit(f"--turns takes 1..{len(QUESTIONS)}, not {args.turns}; --repeats at least 1")
    rows = run(args.model, args.turns, args.document_lines, args.max_tokens, args.link_gbps, args.off, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"off: {args.off} ({OFF_ENV[args.off]}); {args.repeats} chat(s), TTFT the median\n")
    print("| turn | prompt | prefill cached | decode cached | moved on / off (MB) | TTFT on / off (s) | TTFT on/off | "
          "TTST on / off (s) | KV wait on / off (s) | tokens equal |\n|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        on, off = row["on"], row["off"]
        print(f"| {row['turn']} | {on['prompt_tokens']} | {on['cached_tokens']} | {on['decode_cached_tokens']} | "
              f"{on['kv_mb']} / {off['kv_mb']} | {row['ttft_on_s']} / {row['ttft_off_s']} | {row['ttft_ratio']} | "
              f"{on['ttst_s']} / {off['ttst_s']} | {on['kv_wait_s']} / {off['kv_wait_s']} | {row['tokens_equal']} |")


def run(model: str, turns: int, document_lines: int, max_tokens: int, link_gbps: float, off: str = "all",
        repeats: int = 1) -> list[dict]:
    """Per turn: {"turn", "on", "off" (the last chat's figures on each stack), "ttft_on_s", "ttft_off_s" (medians
    over the chats), "ttft_ratio", "ttft_on_all_s", "ttft_off_all_s" (each chat's), "tokens_equal" (every chat)}."""
    with contextlib.ExitStack() as stacks:
        on_stack = stacks.enter_context(_stack(model, link_gbps, {}))
        off_stack = stacks.enter_context(_stack(model, link_gbps, OFF_ENV[off]))
        chats = []
        for r in range(repeats):
            document = "\n".join(f"In year {1800 + i} the harbour of the northern cape saw {(i + r) * 7 % 53} ships, "
                                 f"and the keeper wrote of storm number {i * 3 % 17} in her ledger."
                                 for i in range(document_lines))
            questions = [f"Chronicle {r + 1}:\n{document}\n\n{QUESTIONS[0]}", *QUESTIONS[1:turns]]
            chats.append(_chat_both(on_stack, off_stack, questions, max_tokens))
    rows = []
    for k in range(turns):
        on_all, off_all = [chat[k][0] for chat in chats], [chat[k][1] for chat in chats]
        ttft_on = statistics.median(t["ttft_s"] for t in on_all)
        ttft_off = statistics.median(t["ttft_s"] for t in off_all)
        rows.append({"turn": k + 1, "on": on_all[-1], "off": off_all[-1], "ttft_on_s": round(ttft_on, 3),
                     "ttft_off_s": round(ttft_off, 3), "ttft_ratio": round(ttft_on / ttft_off, 3),
                     "ttft_on_all_s": [t["ttft_s"] for t in on_all], "ttft_off_all_s": [t["ttft_s"] for t in off_all],
                     "tokens_equal": all(a.pop("token_ids") == b.pop("token_ids") for a, b in zip(on_all, off_all))})
    return rows


@contextlib.contextmanager
def _stack(model: str, link_gbps: float, env: dict[str, str]):
    """A fresh stack with `env` (one torch thread a process, links paced)."""
    logs = Path(tempfile.mkdtemp(prefix="smartgen-conversation-"))
    spec = StackSpec(model=model, gateway_port=free_port(), log_file=logs / "stack.log",
                     env={"SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_LINK_GBPS": str(link_gbps), **env})
    with started_stack(spec, 600) as stack:
        yield stack


def _chat_both(on_stack, off_stack, questions: list[str], max_tokens: int) -> list[tuple[dict, dict]]:
    """The chat (full mode, greedy) on both stacks, each turn asked of `on_stack` then `off_stack`; per turn the
    figures of each. Each stack continues from its own answers."""
    histories: tuple[list[dict], list[dict]] = ([], [])
    turns = []
    for question in questions:
        turns.append(tuple(_ask(stack, messages, question, max_tokens)
                           for stack, messages in zip((on_stack, off_stack), histories)))
    return turns


def _ask(stack, messages: list[dict], question: str, max_tokens: int) -> dict:
    """One turn: `question` after `messages` (which gets both the question and the answer); its figures."""
    messages.append({"role": "user", "content": question})
    status, body = post_json(stack.gateway_url + "/v1/chat/completions",
                             {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                              "transfer_mode": "full"}, timeout=1800)
    if status != 200:
        raise SystemExit(f"bench conversation: the chat failed ({status}): {body}")
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    sg = body["smartgen"]
    return {"prompt_tokens": body["usage"]["prompt_tokens"], "cached_tokens": sg["cached_tokens"],
            "decode_cached_tokens": sg["decode_cached_tokens"], "kv_mb": round(sg["kv_bytes"].get("full", 0) / 1e6, 3),
            "ttft_s": round(sg["ttft_s"], 3), "ttst_s": round(sg["ttst_s"], 3), "kv_wait_s": round(sg["kv_wait_s"], 3),
            "token_ids": sg["token_ids"]}
