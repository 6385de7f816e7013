"""A small stand-in for the NATS CLI (which is not installable from the package registries here).

    python -m tools.natsctl [--server URL] micro ls            # every nats.micro service ($SRV.INFO)
    python -m tools.natsctl [--server URL] micro stats         # per-endpoint request/error counts
    python -m tools.natsctl [--server URL] sub 'smartgen.>'     # print messages, msgpack decoded to JSON
    python -m tools.natsctl [--server URL] kv ls BUCKET         # keys of a JetStream key-value bucket

The server defaults to $SMARTGEN_NATS_URL, else nats://127.0.0.1:4222; credentials and TLS come from the
same variables the services read (SMARTGEN_NATS_TOKEN or SMARTGEN_NATS_TOKEN_FILE, …; see shared/runtime/natsconn.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

import msgpack
import nats

from shared.runtime.config import ConfigError
from shared.runtime.natsconn import client_options


def _show(data: bytes) -> str:
    try:
        return json.dumps(msgpack.unpackb(data, raw=False), default=repr)
    except Exception:
        try:
            return json.dumps(json.loads(data))
        except Exception:
            return repr(data[:200])


async def _gather(nc, subject: str, wait_s: float = 0.5) -> list[dict]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    replies = []
    while True:
        try:
            msg = await sub.next_msg(timeout=wait_s)
        except nats.errors.TimeoutError:
            return replies
        if msg.data:  # an empty message is the server's "no responders" status
            replies.append(json.loads(msg.data))


async def run(args: argparse.Namespace) -> None:
    try:
        options = client_options(server=args.server)
    except ConfigError as exc:
        raise SystemExit(f"natsctl: {exc}") from None
    nc = await nats.connect(**options, name="natsctl")
    try:
        if args.command == "micro":
            for info in sorted(await _gather(nc, "$SRV.INFO" if args.what == "ls" else "$SRV.STATS"), key=lambda i: i["name"]):
                if args.what == "ls":
                    print(f"{info['name']:<20} {info['id']:<24} {info.get('metadata', {}).get('worker_id', '')}")
                    for ep in info.get("endpoints", []):
                        print(f"    {ep['subject']}")
                else:
                    for ep in info.get("endpoints", []):
                        print(f"{info['name']:<20} {ep['subject']:<48} requests={ep['num_requests']} errors={ep['num_errors']}")
        elif args.command == "sub":
            sub = await nc.subscribe(args.subject)
            async for msg in sub.messages:
                print(f"[{msg.subject}] {_show(msg.data)}", flush=True)
        elif args.command == "kv":
            kv = await nc.jetstream().key_value(args.bucket)
            try:
                print("\n".join(sorted(await kv.keys())))
            except nats.js.errors.NoKeysError:
                pass
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="natsctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=os.environ.get("SMARTGEN_NATS_URL") or "nats://127.0.0.1:4222")
    sub = parser.add_subparsers(dest="command", required=True)
    micro = sub.add_parser("micro")
    micro.add_argument("what", choices=["ls", "stats"])
    s = sub.add_parser("sub")
    s.add_argument("subject")
    kv = sub.add_parser("kv")
    kv.add_argument("action", choices=["ls"])
    kv.add_argument("bucket")
    try:
        asyncio.run(run(parser.parse_args()))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
