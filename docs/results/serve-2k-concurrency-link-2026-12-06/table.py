"""The README's tables from a `bench serve --concurrency 1,2` run's folder: every smartgen request at concurrency 2
beside the same prompt served alone (c1), and per pair which prefill ran first (from the stack log).

    python docs/results/serve-2k-concurrency-link-2026-12-06/table.py docs/results/serve-2k-concurrency-link-2026-12-06/lane-share
"""
import gzip
import json
import statistics as st
import sys
from datetime import datetime
from pathlib import Path


def smartgen(path: Path) -> dict[int, dict]:
    return {q["sample"]: q for q in json.loads(path.read_text())["requests"] if q["mode"] == "smartgen"}


def pairs(root: Path, two: dict[int, dict]) -> list[dict]:
    """Per pair (samples 2k, 2k+1, served together): the smartgen prefills' log lines, the first one first."""
    lines = [json.loads(line) for line in gzip.open(root / "stack.log.gz", "rt")
             if '"prefill_done"' in line and '"smartgen"' in line][-len(two):]  # concurrency 2 ran last
    out = []
    for k in range(len(two) // 2):
        first, second = sorted(lines[2 * k: 2 * k + 2], key=lambda d: d["waited_s"])
        sample = {two[s]["prompt_tokens"]: s for s in (2 * k, 2 * k + 1)}
        at = [datetime.fromisoformat(d["timestamp"].rstrip("Z")) for d in (first, second)]
        out.append({"first": sample[first["tokens"]], "second": sample[second["tokens"]], "log": second,
                    "token_one_waited": abs((at[1] - at[0]).total_seconds()) < 1.0})
    return out


def main(root: Path) -> None:
    one, two = smartgen(root / "c1/runs.json"), smartgen(root / "c2/runs.json")
    order = {}
    print("| prompt | task | its prefill | c1 TTST | c1 bound | c2 TTST | c2 ÷ c1 bound | c2 ÷ own bound | c2 ÷ c1 TTST | c1 TBT | c2 TBT |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in pairs(root, two):
        order[p["first"]], order[p["second"]] = "first", "second"
    for s in sorted(two):
        a, b = one[s], two[s]
        print(f"| {s} | {b['task']} | {order[s]} | {a['ttst_s']:.2f} | {a['ttst_bound_s']:.2f} | {b['ttst_s']:.2f} | "
              f"{b['ttst_s'] / a['ttst_bound_s']:.2f} | {b['ttst_s'] / b['ttst_bound_s']:.2f} | {b['ttst_s'] / a['ttst_s']:.2f} | "
              f"{a['tbt_s']:.3f} | {b['tbt_s']:.3f} |")
    mean = lambda d, k: st.mean(q[k] for q in d.values())
    print(f"\nMeans: c1 TTST {mean(one, 'ttst_s'):.2f} s, TBT {mean(one, 'tbt_s'):.3f} s; "
          f"c2 TTST {mean(two, 'ttst_s'):.2f} s, TBT {mean(two, 'tbt_s'):.3f} s.\n")
    print("| pair | first: token 1 at | its token 1 waited for the second prefill | second: pushed during its prefill | "
          "its prefill s | first TTST / TBT | second TTST / TBT |")
    print("|---|---|---|---|---|---|---|")
    for k, p in enumerate(pairs(root, two)):
        f, s, log = two[p["first"]], two[p["second"]], p["log"]
        print(f"| {k} | {f['ttft_s']:.2f} s | {'yes' if p['token_one_waited'] else 'no'} | "
              f"{log['pushed_mb']:.1f} of {log['pushed_mb'] + log['queued_mb']:.1f} MB (link allowed {log['link_allows_mb']:.1f}) | "
              f"{log['prefill_s']:.1f} | {f['ttst_s']:.2f} / {f['tbt_s']:.3f} | {s['ttst_s']:.2f} / {s['tbt_s']:.3f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
