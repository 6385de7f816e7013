"""The benchmark's mode names: what each asks the gateway for (`mode_body`), and which configuration of the
paired evaluation decodes the same answers (`quality_config`, the KL column)."""
from __future__ import annotations

from typing import Any

from schemas import DEFAULT_KV_BUDGET, DEFAULT_PUSH_KV_BITS, SMARTGEN_PATHS, mode_of

UNPACED_MODES = ("colocated", "colocated-selective")  # nothing crosses the link
ONLINE_MODE = "smartgen-online"  # smartgen while kvprofile learns from the requests it serves


def mode_body(name: str, selector: str, kv_budget: float) -> dict[str, Any]:
    """The request extras of a benchmark mode name."""
    sel = {"selector": selector, "kv_budget": kv_budget}
    base, _, path = name.partition("-no-")  # an ablation: a smartgen mode without one path (smartgen-4bit-no-ahead)
    if path:
        if not base.startswith("smartgen") or path not in SMARTGEN_PATHS:
            raise ValueError(f"unknown mode {name!r}: an ablation is a smartgen mode, -no-, one of "
                             f"{', '.join(SMARTGEN_PATHS)}")
        return {**mode_body(base, selector, kv_budget), "ablate": [path]}
    if name == ONLINE_MODE:
        return {"transfer_mode": "smartgen", **sel}
    bodies = {"colocated": {"transfer_mode": "colocated"}, "colocated-selective": {"transfer_mode": "colocated", **sel},
              "full": {"transfer_mode": "full"}, "quantized-2bit": {"transfer_mode": "quantized", "kv_bits": 2},
              "quantized-4bit": {"transfer_mode": "quantized", "kv_bits": 4},
              "quantized-8bit": {"transfer_mode": "quantized", "kv_bits": 8},
              "partial": {"transfer_mode": "partial", **sel},
              "smartgen": {"transfer_mode": "smartgen", "kv_bits": DEFAULT_PUSH_KV_BITS, **sel},  # K8V8 codes: the
              # short-prompt default, named so that long prompts (SELECTIVE_DEFAULTS: K8V4) serve what quality_config scores
              "smartgen-exact": {"transfer_mode": "smartgen", "kv_bits": 0, **sel},  # exact 16-bit KV on every path
              "smartgen-4bit": {"transfer_mode": "smartgen", "kv_bits": 4, **sel},
              "smartgen-8bit": {"transfer_mode": "smartgen", "kv_bits": 8, **sel},
              "auto": {"transfer_mode": "auto", **sel}, "auto-4bit": {"transfer_mode": "auto", "kv_bits": 4, **sel}}
    if name not in bodies:
        raise ValueError(f"unknown mode {name!r}: use {', '.join(bodies)}, or an ablation such as smartgen-no-query")
    return bodies[name]


ALL_MODES = ("colocated", "colocated-selective", "full", "partial", "quantized-4bit", "quantized-8bit", "smartgen", "smartgen-4bit",
             "smartgen-no-proactive", "smartgen-no-parallel", "smartgen-no-background", "smartgen-no-query")


def quality_config(mode: str, selector: str) -> str | None:
    """The configuration of `eval accuracy --paired` whose answers a benchmark mode decodes (tools/eval/paired.py):
    dense for colocated and full; quantized-Nbit for the quantized rows; the selector for colocated-selective,
    partial and exact smartgen; the selector over smartgen's records (`<selector>+k8v<bits>`) for smartgen with
    low-bit KV (its default, K8V8, and smartgen-4bit), whose every entry arrives as a record. None for auto, and
    for a smartgen mode that does not stall (what it attends to depends on when reads land: read-behind-*)."""
    body = mode_body(mode, selector, DEFAULT_KV_BUDGET)
    transfer = body.get("transfer_mode")
    if transfer == "quantized":
        return f"quantized-{body['kv_bits']}bit"
    if transfer == "auto" or "stall" in body.get("ablate", []):
        return None
    if not body.get("selector"):
        return "dense"
    mode = mode_of(transfer)  # a mode whose push may travel as records (the mode table's push_bits): their width
    bits = body.get("kv_bits", mode.default_push_bits) if mode.push_bits else 0
    return f"{body['selector']}+k8v{bits}" if bits else body["selector"]
