"""guidellm (a standard load generator) against a running gateway: concurrent streams on both OpenAI routes,
synthetic prompts of the model's own tokenizer, and a table of what it measured.

    python -m tools.bench.guidellm_run --url http://127.0.0.1:8000 --streams 1,2,4,8 --requests 12 \\
        --out docs/results/guidellm-512-64

guidellm is in the `test` extra. Its scenario is written next to its JSON, so a run can be repeated with
guidellm alone (`guidellm run --scenario <out>/scenario-chat.json`). The model folder (for the tokenizer) is
the gateway's default model unless --model names another.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROUTES = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


def scenario(url: str, route: str, model: Path, streams: list[int], requests: int, prompt_tokens: int,
             output_tokens: int) -> dict:
    return {"metadata": {"name": f"smartgen-{prompt_tokens}-{output_tokens}-{route}",
                         "description": f"{prompt_tokens}-token synthetic prompts, {output_tokens} output tokens"},
            "spec": {"backend": {"kind": "openai_http", "target": url, "request_format": ROUTES[route]},
                     "profile": {"kind": "concurrent"},
                     "tokenizer": {"kind": "hf_auto", "model": str(model)},
                     "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
                     "constraints": [{"kind": "max_requests", "count": requests}]},
            "benchmarks": [{"profile.streams": n} for n in streams]}


def summary(result: dict) -> list[dict]:
    """One row per stream count: requests (ok / errored / incomplete), output tokens/s, ITL and TTFT."""
    rows = []
    for bench in result["benchmarks"]:
        m = bench["metrics"]
        ok = m["request_totals"]

        def p50(name: str) -> float:
            return m[name]["successful"]["median"]

        rows.append({"streams": bench["config"]["strategy"]["streams"], "ok": ok["successful"], "errored": ok["errored"],
                     "incomplete": ok["incomplete"], "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
                     "itl_p50_ms": p50("inter_token_latency_ms"), "ttft_p50_ms": p50("time_to_first_token_ms"),
                     "latency_p50_s": p50("request_latency")})
    return rows


def table(route: str, rows: list[dict]) -> str:
    base = rows[0]
    lines = [f"### {route} ({ROUTES[route]})", "",
             "| streams | ok | errored | incomplete | output tok/s | ÷ 1 stream | ITL p50 ms | ÷ 1 stream | TTFT p50 ms | e2e p50 s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['streams']} | {r['ok']} | {r['errored']} | {r['incomplete']} | {r['output_tok_s']:.1f} | "
                     f"{r['output_tok_s'] / base['output_tok_s']:.2f} | {r['itl_p50_ms']:.0f} | "
                     f"{r['itl_p50_ms'] / base['itl_p50_ms']:.2f} | {r['ttft_p50_ms']:.0f} | {r['latency_p50_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    from shared.runtime.models import default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="model folder for the tokenizer (default: the default model)")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=12, help="requests per stream count")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--routes", default="chat,text")
    parser.add_argument("--out", required=True, help="folder for the scenarios, guidellm's JSON and summary.md")
    args = parser.parse_args()
    guidellm = shutil.which("guidellm") or str(Path(sys.executable).with_name("guidellm"))
    model = Path(args.model) if args.model else default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"guidellm {args.streams} concurrent streams, {args.requests} requests each, {args.prompt_tokens}-token "
             f"synthetic prompts, {args.output_tokens} output tokens, against {args.url}", ""]
    for route in args.routes.split(","):
        path = out / f"scenario-{route}.json"
        path.write_text(json.dumps(scenario(args.url, route, model, [int(s) for s in args.streams.split(",")],
                                            args.requests, args.prompt_tokens, args.output_tokens), indent=1))
        result_path = out / f"{route}.json"
        subprocess.run([guidellm, "run", "--scenario", str(path), "--output", f"kind=json,path={result_path}",
                        "--disable-console-interactive"], check=True)
        parts += [table(route, summary(json.loads(result_path.read_text()))), ""]
    (out / "summary.md").write_text("\n".join(parts))
    print("\n".join(parts))


if __name__ == "__main__":
    main()
