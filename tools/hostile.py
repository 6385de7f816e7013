"""Normal streams alongside hostile clients, against a running gateway on this machine (loopback only).

    python -m tools.hostile --url http://127.0.0.1:8000 [--normal 8] [--slowloris 50] [--never-read 20]
                            [--long-stop 4] [--echo 4] [--echo-tokens 8000] [--echo-logprobs 20] [--max-tokens 64]
                            [--hostile-addr 127.0.0.2] [--leak-check] [--json PATH]

  normal      streaming completions (`ignore_eos`, `max_tokens`): each must end with [DONE] and no error; the
              client's gaps between tokens are measured, once without the hostile clients (baseline), then with
  slowloris   connections that send a request line, then a header line a second and never the blank line that
              ends the headers: the gateway must close each (`header_timeout_s`); when it did is recorded
  never-read  long streaming requests whose client never reads a byte (a 4 KiB receive buffer): a gateway write that
              stalls on one is dropped after the write timeout; they must not hurt the normal streams meanwhile
  long-stop   requests with a stop string of 100,000 characters: each must be a 400, at once
  echo        completions of a prompt of --echo-tokens tokens with `echo` and `logprobs` --echo-logprobs: each must
              be a 4xx at once (the prompt's log-probabilities would not fit one NATS message: docs/api.md, Limits)
              or a whole answer with every prompt token's log-probability, never a 5xx
The hostile clients connect from --hostile-addr (127.0.0.2; "" = the normal streams' address), so that to the
gateway they are another client, as they would be in reality. They start first; the normal streams run while they
are all in place. The result (JSON on stdout, or --json) lists each group's outcomes, with the normal streams' ITL
p99 over their solo run's (`itl_p99_ratio`) and, with --leak-check (the admin token from SMARTGEN_ADMIN_TOKEN[_FILE]),
what the workers still hold afterwards; tests/integration/test_hostile_clients.py runs a small one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
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
    echo: int = 4
    echo_tokens: int = 8000
    echo_logprobs: int = 20
    max_tokens: int = 64
    slowloris_s: float = 15.0  # how long a slowloris connection keeps trickling before it gives up on being closed
    api_key: str = ""
    hostile_addr: str = "127.0.0.2"  # the hostile clients' source address ("" = the system's choice)
    leak_check: bool = False


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
    times, error, done = [], "", False
    try:
        async with session.post(cfg.url + "/v1/completions", json=body, headers=_headers(cfg)) as response:
            if response.status != 200:
                return Stream(False, f"http {response.status}: {(await response.text())[:200]}", [])
            async for line in response.content:  # NOTE: to its end, past [DONE], as a client that keeps its connection
                done = done or line.startswith(b"data: [DONE]")
                if line.startswith(b"data: ") and not done:
                    chunk = json.loads(line[6:])
                    error = error or (json.dumps(chunk["error"])[:200] if "error" in chunk else "")
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                        times.append(time.monotonic())
        if not done:
            return Stream(False, "the stream ended without [DONE]", [])
        gaps = [b - a for a, b in zip(times, times[1:])]
        return Stream(not error and len(times) >= cfg.max_tokens, error, gaps)
    except Exception as exc:  # every failure is an outcome
        return Stream(False, f"{type(exc).__name__}: {exc}", [])


def summary(streams: list[Stream]) -> dict:
    return {"num": len(streams), "num_ok": sum(s.ok for s in streams), "errors": [s.error for s in streams if not s.ok],
            "itl_p99_s": p99([g for s in streams for g in s.token_gaps_s]),
            "itl_p50_s": statistics.median([g for s in streams for g in s.token_gaps_s] or [0.0])}


def _local_addr(cfg: HostileConfig) -> tuple[str, int] | None:
    return (cfg.hostile_addr, 0) if cfg.hostile_addr else None


async def slowloris(host: str, port: int, cfg: HostileConfig) -> float | None:
    """Trickle headers until the server closes the connection: seconds until it did, None if it never did."""
    give_up_s = cfg.slowloris_s
    reader, writer = await asyncio.open_connection(host, port, local_addr=_local_addr(cfg))
    started = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        i = 0
        while time.monotonic() - started < give_up_s:
            writer.write(b"X-Slow-%d: y\r\n" % i)
            await writer.drain()
            i += 1
            try:
                async with asyncio.timeout(HEADER_LINE_EVERY_S):  # NOTE: not wait_for, which can drop a Ctrl-C's cancel
                    if await reader.read(1024) == b"":
                        return time.monotonic() - started
            except TimeoutError:
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
    if cfg.hostile_addr:
        sock.bind((cfg.hostile_addr, 0))
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


async def echo_prompt(session, cfg: HostileConfig) -> tuple[list[int], int]:
    """PROMPT's token ids (the gateway's /tokenize) repeated to `echo_tokens` ids, and the model's max_model_len
    (a longer prompt is a 400 for its length, before its echo is looked at)."""
    async with session.post(cfg.url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}) as reply:
        answer = await reply.json()
    ids = answer["tokens"]
    return (ids * (cfg.echo_tokens // len(ids) + 1))[:cfg.echo_tokens], answer["max_model_len"]


async def echo_logprobs(session, cfg: HostileConfig, prompt_ids: list[int]) -> dict:
    """One completion with `echo` and `logprobs`: its status, how long it took, the parameter a 4xx names, and whether
    it was a clear answer (a 4xx with an error message, or a 200 scoring every prompt token)."""
    body = {"prompt": prompt_ids, "max_tokens": 1, "echo": True, "logprobs": cfg.echo_logprobs, "temperature": 0}
    started = time.monotonic()
    try:
        async with session.post(cfg.url + "/v1/completions", json=body, headers=_headers(cfg)) as response:
            reply = await response.json(content_type=None)
            status = response.status
    except Exception as exc:  # every failure is an outcome
        return {"status": None, "s": time.monotonic() - started, "param": None, "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:200]}
    seconds = time.monotonic() - started
    if 400 <= status < 500:
        error = reply.get("error", {}) if isinstance(reply, dict) else {}
        return {"status": status, "s": seconds, "param": error.get("param"), "ok": bool(error.get("message")),
                "error": str(error.get("message", ""))[:300]}
    scored = len((reply.get("choices") or [{}])[0].get("logprobs", {}).get("tokens", [])) if status == 200 else 0
    return {"status": status, "s": seconds, "param": None, "ok": status == 200 and scored >= len(prompt_ids),
            "error": "" if status == 200 else json.dumps(reply)[:300]}


async def attack(cfg: HostileConfig) -> dict:
    import aiohttp

    parts = urlsplit(cfg.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    hostile_connector = aiohttp.TCPConnector(local_addr=_local_addr(cfg), limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=hostile_connector) as hostile:
        prompt_ids, max_model_len = await echo_prompt(session, cfg) if cfg.echo else ([], 0)
        baseline = await asyncio.gather(*(normal_stream(session, cfg) for _ in range(cfg.normal)))
        lorises = [asyncio.create_task(slowloris(host, port, cfg)) for _ in range(cfg.slowloris)]
        silent = [await asyncio.to_thread(never_reader, host, port, cfg) for _ in range(cfg.never_read)]
        try:
            await asyncio.sleep(1.0)  # every hostile client in place
            async with session.get(cfg.url + "/stats") as reply:
                before = await reply.json()  # the never-reading streams hold their client's slots, the rest wait
            started = time.monotonic()
            statuses, echoes, streams = await asyncio.gather(
                asyncio.gather(*(long_stop(hostile, cfg) for _ in range(cfg.long_stop))),
                asyncio.gather(*(echo_logprobs(hostile, cfg, prompt_ids) for _ in range(cfg.echo))),
                asyncio.gather(*(normal_stream(session, cfg) for _ in range(cfg.normal))))
            normal_s = time.monotonic() - started
            closes = await asyncio.gather(*lorises)
        finally:
            for sock in silent:
                sock.close()
        drained_s = await _drained(session, cfg.url)
    solo, normal = summary(baseline), summary(streams)
    result = {"config": asdict(cfg) | {"api_key": bool(cfg.api_key)}, "baseline": solo,
              "never_read_drained_s": drained_s,
              "normal": normal | {"wall_s": normal_s, "itl_p99_ratio": normal["itl_p99_s"] / solo["itl_p99_s"]
                                  if solo["itl_p99_s"] else None,
                                  "running_before": before["running"], "waiting_before": before["waiting"],
                                  "waiting_client_cap_before": before.get("waiting_client_cap")},
              "slowloris": {"num": len(closes), "num_closed": sum(c is not None for c in closes),
                            "closed_after_max_s": max((c for c in closes if c is not None), default=None)},
              "never_read": {"num": len(silent)},
              "long_stop": {"statuses": statuses},
              "echo": {"prompt_tokens": len(prompt_ids), "max_model_len": max_model_len, "logprobs": cfg.echo_logprobs,
                       "outcomes": echoes}}
    if cfg.leak_check:
        from tools.leaks import find_leaks

        result["leaks"] = await asyncio.to_thread(find_leaks, cfg.url, 10.0)
    return result


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
    for name in ("normal", "slowloris", "never-read", "long-stop", "echo", "echo-tokens", "echo-logprobs",
                 "max-tokens"):
        parser.add_argument(f"--{name}", type=int, default=getattr(HostileConfig, name.replace("-", "_")))
    parser.add_argument("--slowloris-s", type=float, default=HostileConfig.slowloris_s)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--hostile-addr", default=HostileConfig.hostile_addr)
    parser.add_argument("--leak-check", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("tools.hostile talks to loopback only: give a gateway on this machine")
    result = asyncio.run(attack(HostileConfig(
        args.url, args.normal, args.slowloris, args.never_read, args.long_stop, args.echo, args.echo_tokens,
        args.echo_logprobs, args.max_tokens, args.slowloris_s, args.api_key, args.hostile_addr, args.leak_check)))
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
