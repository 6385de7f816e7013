"""Normal streams alongside hostile clients, against a running gateway on this machine (loopback only).

    python -m tools.hostile --url http://127.0.0.1:8000 [--normal 8] [--slowloris 50] [--never-read 20]
                            [--long-stop 4] [--max-tokens 64] [--json PATH]

  normal      streaming completions (`ignore_eos`, `max_tokens`): each must end with [DONE] and no error; the
              client's gaps between tokens are measured, once without the hostile clients (baseline), then with
  slowloris   connections that send a request line, then a header line a second and never the blank line that
              ends the headers: the gateway must close each (`header_timeout_s`); when it did is recorded
  never-read  long streaming requests whose client never reads a byte (a 4 KiB receive buffer): a gateway write that
              stalls on one is dropped after the write timeout; they must not hurt the normal streams meanwhile
  long-stop   requests with a stop string of 100,000 characters: each must be a 400, at once
The hostile clients start first; the normal streams run while they are all in place. The result (JSON on stdout,
or --json) lists each group's outcomes; tests/integration/test_hostile_clients.py runs a small one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

PROMPT = "Tell me a long story about a river city and the people who live by it."
LONG_STOP_CHARS = 100_000
HEADER_LINE_EVERY_S = 1.0
NEVER_READ_TOKENS = 4000


@dataclass
class HostileConfig:
    url: str
    normal: int = 8
    slowloris: int = 50
    never_read: int = 20
    long_stop: int = 4
    max_tokens: int = 64
    slowloris_s: float = 15.0  # how long a slowloris connection keeps trickling before it gives up on being closed
    api_key: str = ""


@dataclass
class Stream:
    ok: bool
    error: str
    token_gaps_s: list[float]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _headers(cfg: HostileConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def normal_stream(session, cfg: HostileConfig) -> Stream:
    """One streaming completion, read as it comes: ok when it ends with [DONE] and carried no error."""
    body = {"prompt": PROMPT, "max_tokens": cfg.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    times, error = [], ""
    try:
        async with session.post(cfg.url + "/v1/completions", json=body, headers=_headers(cfg)) as response:
            if response.status != 200:
                return Stream(False, f"http {response.status}: {(await response.text())[:200]}", [])
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    gaps = [b - a for a, b in zip(times, times[1:])]
                    return Stream(not error and len(times) >= cfg.max_tokens, error, gaps)
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    error = error or (json.dumps(chunk["error"])[:200] if "error" in chunk else "")
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                        times.append(time.monotonic())
        return Stream(False, "the stream ended without [DONE]", [])
    except Exception as exc:  # every failure is an outcome
        return Stream(False, f"{type(exc).__name__}: {exc}", [])


def summary(streams: list[Stream]) -> dict:
    return {"num": len(streams), "num_ok": sum(s.ok for s in streams), "errors": [s.error for s in streams if not s.ok],
            "itl_p99_s": p99([g for s in streams for g in s.token_gaps_s])}


async def slowloris(host: str, port: int, give_up_s: float) -> float | None:
    """Trickle headers until the server closes the connection: seconds until it did, None if it never did."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        i = 0
        while time.monotonic() - started < give_up_s:
            writer.write(b"X-Slow-%d: y\r\n" % i)
            await writer.drain()
            i += 1
            try:
                if await asyncio.wait_for(reader.read(1024), HEADER_LINE_EVERY_S) == b"":
                    return time.monotonic() - started
            except asyncio.TimeoutError:
                continue
        return None
    except ConnectionError:
        return time.monotonic() - started
    finally:
        writer.close()


def never_reader(host: str, port: int, cfg: HostileConfig) -> socket.socket:
    """A streaming request whose client will never read its answer (the caller closes the socket at the end)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # NOTE: before connect, so the window stays small
    sock.connect((host, port))
    # NOTE: ~1 MB of events; loopback's socket buffers can take that much (then no write stalls), a network's may not
    body = json.dumps({"prompt": PROMPT, "max_tokens": NEVER_READ_TOKENS, "ignore_eos": True, "stream": True}).encode()
    auth = f"Authorization: Bearer {cfg.api_key}\r\n" if cfg.api_key else ""
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


async def long_stop(session, cfg: HostileConfig) -> int:
    body = {"prompt": PROMPT, "max_tokens": 8, "stop": ["x" * LONG_STOP_CHARS], "stream": True}
    async with session.post(cfg.url + "/v1/completions", json=body, headers=_headers(cfg)) as response:
        await response.read()
        return response.status


async def attack(cfg: HostileConfig) -> dict:
    import aiohttp

    parts = urlsplit(cfg.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        baseline = await asyncio.gather(*(normal_stream(session, cfg) for _ in range(cfg.normal)))
        lorises = [asyncio.create_task(slowloris(host, port, cfg.slowloris_s)) for _ in range(cfg.slowloris)]
        silent = [await asyncio.to_thread(never_reader, host, port, cfg) for _ in range(cfg.never_read)]
        try:
            await asyncio.sleep(1.0)  # every hostile client in place
            async with session.get(cfg.url + "/stats") as reply:
                running = (await reply.json())["running"]  # the never-reading streams hold their slots
            started = time.monotonic()
            statuses, streams = await asyncio.gather(
                asyncio.gather(*(long_stop(session, cfg) for _ in range(cfg.long_stop))),
                asyncio.gather(*(normal_stream(session, cfg) for _ in range(cfg.normal))))
            normal_s = time.monotonic() - started
            closes = await asyncio.gather(*lorises)
        finally:
            for sock in silent:
                sock.close()
        drained_s = await _drained(session, cfg.url)
    return {"config": asdict(cfg) | {"api_key": bool(cfg.api_key)}, "baseline": summary(baseline),
            "never_read_drained_s": drained_s,
            "normal": summary(streams) | {"wall_s": normal_s, "running_before": running},
            "slowloris": {"num": len(closes), "num_closed": sum(c is not None for c in closes),
                          "closed_after_max_s": max((c for c in closes if c is not None), default=None)},
            "never_read": {"num": len(silent)},
            "long_stop": {"statuses": statuses}}


async def _drained(session, url: str, timeout_s: float = 60.0) -> float | None:
    """Seconds until the gateway runs no request once the never-reading clients have hung up (their streams end
    when the gateway's next write fails; the workers are told then); None if not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        async with session.get(url + "/stats") as reply:
            if (await reply.json())["running"] == 0:
                return time.monotonic() - started
        await asyncio.sleep(0.2)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.hostile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    for name in ("normal", "slowloris", "never-read", "long-stop", "max-tokens"):
        parser.add_argument(f"--{name}", type=int, default=getattr(HostileConfig, name.replace("-", "_")))
    parser.add_argument("--slowloris-s", type=float, default=HostileConfig.slowloris_s)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("tools.hostile talks to loopback only: give a gateway on this machine")
    result = asyncio.run(attack(HostileConfig(args.url, args.normal, args.slowloris, args.never_read, args.long_stop,
                                              args.max_tokens, args.slowloris_s, args.api_key)))
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
