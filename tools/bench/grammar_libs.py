"""Per-token mask cost of the grammar libraries with the model's tokenizer: the measurement behind the choice of
llguidance (docs/structured-output.md). xgrammar is not a dependency: install it beside (pip install --target DIR
xgrammar apache-tvm-ffi --no-deps) and pass DIR as --extra-path.

    python -m tools.bench.grammar_libs llguidance MODEL_DIR [--any-json]
    python -m tools.bench.grammar_libs xgrammar MODEL_DIR --extra-path DIR [--any-json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace, the first programmer", "age": 36, "tags": ["math", "engine", "poetry", "notes"],
          "ok": True}
RUNS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", choices=["llguidance", "xgrammar"])
    parser.add_argument("model_dir", help="a model folder with its tokenizer")
    parser.add_argument("--any-json", action="store_true", help="any JSON object instead of the 4-field schema")
    parser.add_argument("--extra-path", help="a folder to import the library from")
    args = parser.parse_args()
    if args.extra_path:
        sys.path.insert(0, args.extra_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    schema = {"type": "object"} if args.any_json else SCHEMA
    ids = tokenizer(json.dumps(ANSWER), add_special_tokens=False)["input_ids"]
    vocab = len(tokenizer)
    started = time.perf_counter()
    if args.library == "xgrammar":
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        set_up = time.perf_counter()
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_builtin_json_grammar() if args.any_json else compiler.compile_json_schema(json.dumps(schema))
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def one_pass() -> list[float]:
            matcher, times = xgr.GrammarMatcher(compiled), []
            for token in ids:
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                assert matcher.accept_token(token)
                times.append(time.perf_counter() - t)
            return times
    else:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        set_up = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        compiled = llguidance.LLMatcher(lltokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def one_pass() -> list[float]:
            matcher, times = compiled.deep_copy(), []
            for token in ids:
                t = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                assert matcher.consume_token(token), matcher.get_error()
                times.append(time.perf_counter() - t)
            return times
    compiled_at = time.perf_counter()
    one_pass()  # warm
    times = sorted(t for _ in range(RUNS) for t in one_pass())
    print(f"{args.library}: vocab {vocab}, {len(ids)} tokens × {RUNS}; tokenizer setup {1e3 * (set_up - started):.0f} ms; "
          f"compile {1e3 * (compiled_at - set_up):.1f} ms; mask + advance per token: median "
          f"{1e6 * statistics.median(times):.0f} µs, p90 {1e6 * times[int(0.9 * len(times))]:.0f} µs, "
          f"max {1e6 * times[-1]:.0f} µs")


if __name__ == "__main__":
    main()
