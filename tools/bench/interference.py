"""`smartgen bench interference`: what receiving KV costs a decode step running beside it, with the data plane
in the worker's own process (TCP on its event loop, sharing the GIL with the torch thread) and in a transfer
agent (shared/dataplane/agent.py: a process of its own over the same shared-memory arena).

This process decodes SmolLM2 steps (selective, quest, on a prefilled slab of `context` tokens, one torch thread,
each step on a thread of its own as in a worker) while a peer process pushes 16 MiB after 16 MiB into its region,
unpaced or paced to a set rate. Reported per data plane: the step's median and mean time with the link idle and
with it busy, and the bytes that landed per second meanwhile. Both planes are measured in the same run, each
against its own idle baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.args import add_json
from tools.bench.transport import machine, spawned_peer

FLOOD_BYTES = 16 << 20  # one push of the peer
TICKET = 7


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `interference` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("interference", help="decode-step time while KV lands: in-process data plane vs "
                                                        "transfer agent (~2 min)")
    add_json(bench, "also write the results here")
    bench.add_argument("--context", type=int, default=2048, help="the decoded request's context, tokens")
    bench.add_argument("--steps", type=int, default=30, help="decode steps timed per row")
    bench.add_argument("--gbps", type=float, nargs="+", default=[0.0, 1.0],
                       help="the peer's link rates to measure under (0 = unpaced)")
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    run(args.context, args.steps, args.gbps, args.json)


# --- the peer: pushes into our region, over and over ------------------------------------------------------
def _peer_main(conn) -> None:
    asyncio.run(_peer(conn))


async def _peer(conn) -> None:
    from shared.dataplane import Lane, Segment
    from tools.bench.transport import started_peer_plane

    loop = asyncio.get_running_loop()
    plane = await started_peer_plane(FLOOD_BYTES)
    flood: asyncio.Task | None = None
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if flood:
            flood.cancel()
            await asyncio.gather(flood, return_exceptions=True)
            flood = None
        if cmd == "flood":
            address, dst, gbps = arg
            plane.set_link_gbps(gbps)

            async def push_forever() -> None:
                while True:
                    await plane.push(address, TICKET, [Segment(0, dst, FLOOD_BYTES)], Lane.PUSH)
            flood = asyncio.create_task(push_forever())
        elif cmd == "quit":
            await plane.close()
            conn.send("bye")
            return
        conn.send("ok")


# --- this process: decode steps beside the data plane -------------------------------------------------------
def run(context: int = 2048, steps: int = 30, rates: list[float] | None = None, json_path: str | None = None) -> dict:
    rates = rates if rates is not None else [0.0, 1.0]
    with spawned_peer(_peer_main) as peer:
        rows = asyncio.run(_measure(peer, context, steps, rates))
    _print(rows, context)
    report = {"context": context, "steps": steps, "rows": rows, "machine": machine()}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report


async def _measure(peer, context: int, steps: int, rates: list[float]) -> list[dict]:
    import torch
    from transformers import AutoTokenizer

    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.dataplane import Grant, make_dataplane
    from shared.dataplane.agent import AgentDataPlane
    from shared.runtime.models import resolve_model
    from tools.workloads import stdlib_files

    torch.set_num_threads(1)  # as `smartgen up` gives a model process on this machine
    loop = asyncio.get_running_loop()
    torch_thread = ThreadPoolExecutor(1)
    path = resolve_model("")
    runner = ModelRunner(path)
    layout = runner.kv_layout(16)
    store = KvStore.with_capacity_mb(layout, (context + 4 * steps) * layout.token_bytes // 2**20 + 40, shared=True)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = tokenizer(text)["input_ids"][:context]
    _, cache = runner.prefill(ids)
    landing = store.allocate("landing", FLOOD_BYTES // layout.token_bytes + 1)  # where the peer's pushes land
    landing_at = store.offset(landing)

    async def time_steps() -> list[float]:
        slab = store.allocate("r", len(ids) + steps)
        for layer in range(runner.num_layers):
            store.write_layer(slab, layer, cache.layers[layer].keys[0], cache.layers[layer].values[0])
        engine.load_from_store("r", slab, len(ids))
        engine.use_selection("r", "quest", 0.1)
        times, token = [], ids[-1]
        for _ in range(steps):
            started = time.perf_counter()
            token = int((await loop.run_in_executor(torch_thread, engine.step_logits, "r", token)).argmax())
            times.append(time.perf_counter() - started)
        engine.end("r")
        store.free("r")
        return times[2:]  # the first steps warm caches up

    async def ask(cmd: str, arg: object) -> None:
        peer.send((cmd, arg))
        assert await loop.run_in_executor(None, peer.recv) == "ok"

    rows = []
    for kind in ("in-process", "agent"):
        plane = AgentDataPlane(store.shared_arena) if kind == "agent" else make_dataplane("tcp")
        plane.register_region(store.region)
        await plane.start()
        grant = Grant(TICKET, [(landing_at, landing_at + FLOOD_BYTES)])
        plane.grant(grant)
        idle = await time_steps()
        rows.append(_row(kind, "idle", None, idle, 0.0))
        for gbps in rates:
            landed, started = grant.bytes_landed, time.monotonic()
            await ask("flood", (plane.address, landing_at, gbps))
            busy = await time_steps()
            rate = (grant.bytes_landed - landed) / (time.monotonic() - started)
            await ask("stop", None)
            rows.append(_row(kind, "busy", gbps, busy, rate, statistics.median(idle)))
        await plane.close()
    torch_thread.shutdown()
    return rows


def _row(plane: str, link: str, gbps: float | None, times: list[float], landed_bytes_s: float,
         idle_median_s: float | None = None) -> dict:
    median = statistics.median(times)
    return {"plane": plane, "link": link, "gbps": gbps, "n": len(times), "step_median_ms": median * 1e3,
            "step_mean_ms": statistics.fmean(times) * 1e3, "landed_mb_s": landed_bytes_s / 1e6,
            "vs_idle": median / idle_median_s if idle_median_s else 1.0}


def _print(rows: list[dict], context: int) -> None:
    print(f"decode step (SmolLM2, quest 0.1, {context} tokens, 1 torch thread) while a peer pushes KV into this process")
    print(f"{'data plane':<12} {'link':<16} {'n':>3} {'median ms':>10} {'mean ms':>8} {'× idle':>7} {'landed MB/s':>12}")
    for r in rows:
        link = "idle" if r["link"] == "idle" else f"busy, {r['gbps']:g} Gbit/s" if r["gbps"] else "busy, unpaced"
        print(f"{r['plane']:<12} {link:<16} {r['n']:>3} {r['step_median_ms']:>10.1f} {r['step_mean_ms']:>8.1f} "
              f"{r['vs_idle']:>7.2f} {r['landed_mb_s']:>12.1f}")
