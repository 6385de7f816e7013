"""`smartgen profile build|list|show|delete`: the KV-profile service of a running stack, from the command line.

    smartgen profile build --selector quest --prompt-tokens 2048 [--num-prompts 4] [--decode-steps 16]
    smartgen profile list | show KEY | delete KEY

It talks to the stack's NATS (SMARTGEN_NATS_URL, default nats://127.0.0.1:4222, with the credentials of
SMARTGEN_NATS_TOKEN(_FILE) or SMARTGEN_NATS_USER/PASSWORD(_FILE), as the services take them) and finds the kvprofile
worker from its heartbeat; a build shows a progress bar fed by the service's progress events.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

from schemas import (DEFAULT_KV_BUDGET, DEFAULT_SELECTOR, Ack, BuildProfile, BuildProgress, ListQuery, Profile,
                     ProfileInfo, ProfileKey, ProfileList, decode, subjects)

FIND_TIMEOUT_S = 5.0
BUILD_TIMEOUT_S = 3600.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `profile` to the `smartgen` sub-commands."""
    prof = subparsers.add_parser("profile", help="positional importance profiles in a running stack's kvprofile service")
    prof.add_argument("action", choices=["build", "list", "show", "delete"], help="what to do with the profiles")
    prof.add_argument("key", nargs="?", help="show/delete: the profile key (see `smartgen profile list`)")
    prof.add_argument("--selector", default=DEFAULT_SELECTOR, help="build: the selector to profile (default %(default)s)")
    prof.add_argument("--prompt-tokens", type=int, default=2048, help="calibration prompt length (sets the bucket)")
    prof.add_argument("--num-prompts", type=int, default=4, help="build: calibration prompts (default 4)")
    prof.add_argument("--decode-steps", type=int, default=16, help="build: decode steps observed per prompt (default 16)")
    prof.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET,
                      help="build: share of the KV the selector picks (default %(default)s)")
    prof.set_defaults(run=command)


async def _kvprofile(nc) -> str:
    """The worker id of a kvprofile service heartbeating on `nc` (SystemExit if none within FIND_TIMEOUT_S)."""
    from shared.runtime.registry import WorkerRegistry

    registry = WorkerRegistry(ttl_s=30)
    await registry.follow(nc, f"cli-{uuid.uuid4().hex[:6]}")
    for _ in range(int(FIND_TIMEOUT_S / 0.1)):
        workers = registry.alive("kvprofile")
        if workers:
            return workers[0].worker_id
        await asyncio.sleep(0.1)
    raise SystemExit("smartgen profile: no kvprofile service answers on this NATS (is the stack up? "
                     "set SMARTGEN_NATS_URL)")


async def _run(args) -> int:
    # NOTE: nats and the services' helpers load here, not at import, so `smartgen --help` starts fast
    import nats
    import numpy as np

    from shared.runtime.config import ConfigError
    from shared.runtime.natsconn import client_options, redacted_url
    from shared.runtime.profiles import importance_of
    from shared.runtime.rpc import RemoteError, call

    try:
        options = client_options()
    except ConfigError as exc:
        raise SystemExit(f"smartgen profile: {exc}") from None
    url = redacted_url(options["servers"][0])
    try:
        nc = await nats.connect(**options, connect_timeout=3, max_reconnect_attempts=0)
    except Exception as exc:
        raise SystemExit(f"smartgen profile: cannot reach NATS at {url}: {exc} (a token? set SMARTGEN_NATS_TOKEN "
                         "or SMARTGEN_NATS_TOKEN_FILE)") from None
    try:
        worker = await _kvprofile(nc)
        subject = lambda verb: subjects.worker("kvprofile", worker, verb)  # noqa: E731
        if args.action == "list":
            listed = await call(nc, subject("list"), ListQuery(""), ProfileList, 5)
            for key in listed.keys:
                print(key)
            return 0
        if args.action in ("show", "delete"):
            if not args.key:
                raise SystemExit(f"smartgen profile {args.action}: name the profile KEY (see `smartgen profile list`)")
            if args.action == "delete":
                await call(nc, subject("delete"), ProfileKey(args.key), Ack, 5)
                print(f"deleted {args.key}")
                return 0
            profile = await call(nc, subject("show"), ProfileKey(args.key), Profile, 5)
            rows = importance_of(profile)
            print(json.dumps({"key": profile.key, "version": profile.version, "source": profile.source,
                              "num_prompts": profile.num_prompts, "num_updates": profile.num_updates,
                              "mean_importance_per_layer": [round(float(r.mean()), 4) for r in rows],
                              "top_blocks_last_layer": [int(b) for b in np.argsort(-rows[-1])[:16]]}, indent=2))
            return 0
        return await _build(nc, subject("build"), args)
    except RemoteError as exc:
        print(f"smartgen profile: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await nc.close()


async def _build(nc, subject: str, args) -> int:
    from tqdm import tqdm

    from shared.runtime.rpc import call

    progress_subject = subjects.profile_progress(uuid.uuid4().hex[:12])
    bar = tqdm(total=args.num_prompts, desc=f"profile {args.selector}/{args.prompt_tokens}", unit="prompt")

    async def on_progress(msg) -> None:
        p = decode(BuildProgress, msg.data)
        bar.total = p.total
        bar.n = p.done
        bar.set_postfix_str(p.stage)
        bar.refresh()

    await nc.subscribe(progress_subject, cb=on_progress)
    try:
        info = await call(nc, subject, BuildProfile(args.selector, args.prompt_tokens, args.num_prompts, args.decode_steps,
                                                    args.kv_budget, progress_subject), ProfileInfo, BUILD_TIMEOUT_S)
    finally:
        bar.close()
    print(f"built {info.key} version {info.version} from {info.num_prompts} prompts")
    return 0


def command(args: argparse.Namespace) -> int:
    """`smartgen profile ACTION`: exit code 0, or 1 when the service refused (its message on stderr)."""
    return asyncio.run(_run(args))
