"""The stack and the link a `smartgen bench serve` run measures on (tools/bench/serve.py's docstring, steps 1–2): a
gateway (a started stack unless a URL is given), this machine's calibration (prefill rate, KV bytes per token), and
the link rate a pressure R sets in each pacing regime."""
from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tools.client import Gateway

if TYPE_CHECKING:
    from tools.stack import Stack

STEP_MATCH = 10.0  # step-matched links are this much faster than prefill-matched ones (serve.py's docstring)


@contextmanager
def gateway_for(url: str, model: str, out: Path,
                extra_env: dict[str, str] | None = None) -> Iterator[tuple[Gateway, Stack | None]]:
    """(client, None) of the gateway at `url`; without one, (client, stack) of a stack started for the run and
    stopped on exit: 1 prefill + 1 decode on an embedded NATS, logging to out/stack.log, ready when yielded."""
    if url:
        yield Gateway(url), None
        return
    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack

    # NOTE: generous timeouts: a full transfer at R = 6.5 of a 4K prompt takes minutes on this CPU
    # NOTE: the prefix cache off unless asked (--prefix-hit): every mode serves the same prompts, and each would
    # find the prompt cached by the one before. The decode side's is always off: full mode would move only what the
    # decode worker lacks, where the paper's setting has the decode node receive the whole prompt's KV
    # NOTE: no per-client cap: the benchmark is one client measuring the whole server (--concurrency C: C in flight)
    env = {"SMARTGEN_MAX_RUNNING_PER_CLIENT": "0", "SMARTGEN_MAX_WAITING_PER_CLIENT": "0",
           "SMARTGEN_KV_TIMEOUT_S": "1800", "SMARTGEN_PUSH_TIMEOUT_S": "1800", "SMARTGEN_OPEN_TIMEOUT_S": "1800",
           "SMARTGEN_REQUEST_TIMEOUT_S": "1800", "SMARTGEN_KV_CACHE_MB": "1024", "SMARTGEN_PREFIX_CACHE_MB": "0",
           "SMARTGEN_DECODE_PREFIX_CACHE_MB": "0", **(extra_env or {})}
    spec = StackSpec(model=model, gateway_port=free_port(), log_file=out / "stack.log", env=env)
    with started_stack(spec, 300) as stack:
        yield Gateway(stack.gateway_url, stack.admin_token), stack


def link_of(setting: tuple[str, float], calib: dict, regime: str) -> tuple[float, float | None]:
    """(link_gbps, pressure R) of a setting for one prompt length, in a pacing regime (module docstring)."""
    kind, value = setting
    if kind == "gbps" and not value:
        return 0.0, None
    bits_per_s_full = calib["kv_bytes_per_token"] * 8 * calib["prefill_tokens_per_s"]  # R = 1
    if kind == "pressure":
        return bits_per_s_full / value / 1e9 * (STEP_MATCH if regime == "step" else 1.0), value
    return value, (bits_per_s_full / (value * 1e9) if value else None)


def calibrate(gateway: Gateway, prompt: str) -> dict:
    """One unpaced full-mode request (after a warm-up): this machine's prefill rate and KV bytes per token.
    NOTE: each opens with a line of its own, so where the prefix cache is on neither finds a page of it cached: the
    rate is the whole prefill's."""
    for tag in ("warm-up", "calibration"):
        res = gateway.complete({"prompt": f"{tag} {secrets.token_hex(4)}\n{prompt}", "max_tokens": 2, "temperature": 0,
                                "transfer_mode": "full"})
    n = res["prompt_tokens"]
    return {"prompt_tokens": n, "prefill_s": res["prefill_s"], "prefill_tokens_per_s": n / res["prefill_s"],
            "kv_bytes_per_token": res["kv_bytes"]["full"] / n}
