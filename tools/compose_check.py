"""Check a running `docker compose` stack the way a user would find it: the OpenAI API through the `openai` SDK,
every scaled worker serving, data-plane links between containers authenticated, a stranger refused, a crashed
worker restarted by Docker; with compose/nats-cluster.yml, the stack outliving its JetStream meta leader.

    docker compose -p sg up -d --wait --scale prefill=2 --scale decode=2
    python -m tools.compose_check --project sg --json docs/results/compose/check.json
    # or: docker compose -p sg -f docker-compose.yml -f compose/nats-cluster.yml up -d --wait --scale …

Needs the Docker CLI (workers publish no host port, so their /stats are read with `docker exec`). Exits 1 when a
check fails; prints one line per check.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from shared.dataplane.frames import HEADER
from shared.dataplane.handshake import NONCE_BYTES

ADMIN_PORTS = {"prefill": 9103, "decode": 9104}
DATAPLANE_PORTS = {"prefill": 9203, "decode": 9204}
# All a stranger may receive: the listener's challenge (a frame header and a nonce), then the link is cut.
CHALLENGE_FRAME_BYTES = HEADER.size + NONCE_BYTES
PROMPT = "Explain, in two sentences, why the sky looks blue during the day. " * 8


def docker(*args: str, timeout: float = 60) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=timeout).stdout


def containers(project: str, role: str) -> list[str]:
    """Names of the project's running containers of one compose service, sorted."""
    out = docker("ps", "--filter", f"label=com.docker.compose.project={project}",
                 "--filter", f"label=com.docker.compose.service={role}", "--format", "{{.Names}}")
    return sorted(out.split())


def worker_stats(container: str, role: str) -> dict:
    code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{ADMIN_PORTS[role]}/stats')"
            ".read().decode())")
    return json.loads(docker("exec", container, "python", "-c", code))


def container_state(container: str) -> dict:
    """The container's State (Pid, Running…) and its restart count, from one `docker inspect`."""
    info = json.loads(docker("inspect", container))[0]
    return info["State"] | {"restarts": info["RestartCount"]}


async def drive(url: str, n: int) -> list[dict]:
    """n concurrent greedy requests, alternating a streamed chat and a plain completion."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    model = (await client.models.list()).data[0].id

    async def one(i: int) -> dict:
        start = time.perf_counter()
        if i % 2 == 0:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0,
                stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            route = "chat-stream"
        else:
            reply = await client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
            text, route = reply.choices[0].text, "completions"
        return {"route": route, "seconds": round(time.perf_counter() - start, 2), "text": text}

    return await asyncio.gather(*(one(i) for i in range(n)))


def smartgen_request(url: str) -> dict:
    """One greedy completion in smartgen mode (selective transfer: push, on-demand and background paths) over a
    1,100-token prompt; what its response says about the bytes each path moved."""
    import urllib.request

    model = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=30))["data"][0]["id"]
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 110, "max_tokens": 16,
            "temperature": 0, "transfer_mode": "smartgen"}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=120))
    info = reply.get("smartgen", {})
    return {"text": reply["choices"][0]["text"], "transfer_mode": info.get("transfer_mode"),
            "kv_bytes": info.get("kv_bytes", {}), "local_share": info.get("local_share")}


def http_json(url: str) -> dict:
    import urllib.request

    return json.load(urllib.request.urlopen(url, timeout=30))


def nats_cluster_loses_its_leader(project: str, url: str, n: int) -> dict:
    """With compose/nats-cluster.yml: the profiles bucket keeps 3 copies; stop the JetStream meta leader's
    container, and the stack still serves and kvprofile still reads the bucket; then start it again."""
    jsz = http_json("http://127.0.0.1:8222/jsz?accounts=true&streams=true&config=true")
    meta = jsz["meta_cluster"]
    streams = [s for a in jsz.get("account_details", []) for s in a.get("stream_detail", [])]
    replicas = {s["name"]: s["config"]["num_replicas"] for s in streams}
    leader = meta["leader"]  # a server name: nats-1 is the `nats` service, nats-2 and nats-3 their own
    container = f"{project}-{'nats' if leader == 'nats-1' else leader}-1"
    profiles_before = http_json("http://127.0.0.1:9102/profiles")
    docker("stop", container)
    try:
        replies = asyncio.run(drive(url, n))
        profiles_after = http_json("http://127.0.0.1:9102/profiles")
    finally:
        docker("start", container)
    return {"cluster_size": meta["cluster_size"], "bucket_replicas": replicas, "stopped_leader": leader,
            "replies_without_it": replies, "profiles_readable": profiles_after == profiles_before}


def stranger_is_refused(project: str, target: str, role: str) -> dict:
    """A container on the compose network without the cluster secret connects to a worker's data-plane port and
    sends bytes: the worker must close the link before anything else happens and count a refused peer."""
    before = worker_stats(target, role)["dataplane"]["peers_refused"]
    probe = ("import socket; s = socket.create_connection(('%s', %d), timeout=10); s.settimeout(10); data = b''\n"
             "try:\n    s.sendall(b'\\x00' * 4096)\n    while chunk := s.recv(65536):\n        data += chunk\n"
             "except ConnectionError:\n    pass\nprint(len(data))") % (target, DATAPLANE_PORTS[role])
    received = docker("run", "--rm", "--network", f"{project}_default", "smartgen:latest", "python", "-c", probe)
    after = worker_stats(target, role)["dataplane"]["peers_refused"]
    return {"bytes_the_stranger_got": int(received.strip()), "peers_refused_before": before,
            "peers_refused_after": after}


def crash_and_wait(container: str, role: str, limit_s: float = 90) -> dict:
    """SIGKILL the worker's process from the host (a crash, not `docker stop`), then wait for Docker's restart
    policy to bring it back and for the worker to report ready."""
    state = container_state(container)
    subprocess.run(["kill", "-9", str(state["Pid"])], check=True)
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        time.sleep(1)
        now = container_state(container)
        if now["Running"] and now["restarts"] > state["restarts"]:
            try:
                if worker_stats(container, role).get("ready"):
                    return {"restarted": True, "back_after_s": round(time.monotonic() - start, 1),
                            "restarts": now["restarts"]}
            except (subprocess.CalledProcessError, json.JSONDecodeError):
                pass
    return {"restarted": False, "back_after_s": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True, help="the compose project name (-p)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", help="write the checks and their evidence here")
    args = parser.parse_args(argv)

    checks: list[tuple[str, bool, object]] = []
    workers = {role: containers(args.project, role) for role in ADMIN_PORTS}
    checks.append(("workers running", all(workers.values()), workers))

    replies = asyncio.run(drive(args.url, args.requests))
    same = {r["route"]: r["text"] for r in replies}
    ok = all(r["text"] for r in replies) and all(r["text"] == same[r["route"]] for r in replies)
    checks.append(("openai SDK: every reply non-empty, greedy replies equal per route", ok, replies))

    stats = {name: worker_stats(name, role)["dataplane"] for role, names in workers.items() for name in names}
    moved = {name: s["bytes_sent"] + s["bytes_received"] for name, s in stats.items()}
    addresses = {name: s["address"] for name, s in stats.items()}
    checks.append(("every worker moved KV over its own data-plane address",
                   all(moved.values()) and len(set(addresses.values())) == len(addresses),
                   {"bytes": moved, "addresses": addresses}))
    checks.append(("every data-plane link authenticated", all(s["authenticated"] for s in stats.values()),
                   {name: s["authenticated"] for name, s in stats.items()}))

    selective = smartgen_request(args.url)
    checks.append(("a smartgen-mode request moves KV on its paths between containers",
                   bool(selective["text"]) and selective["transfer_mode"] == "smartgen"
                   and selective["kv_bytes"].get("proactive", 0) > 0, selective))

    decode = workers["decode"][0]
    stranger = stranger_is_refused(args.project, decode, "decode")
    checks.append(("a stranger without the cluster secret is refused before any KV byte moves",
                   stranger["bytes_the_stranger_got"] <= CHALLENGE_FRAME_BYTES
                   and stranger["peers_refused_after"] == stranger["peers_refused_before"] + 1, stranger))

    crash = crash_and_wait(decode, "decode")
    checks.append(("a crashed decode worker is restarted and ready", crash["restarted"], crash))
    again = asyncio.run(drive(args.url, args.requests))
    checks.append(("the stack serves again after the restart",
                   all(r["text"] == same[r["route"]] for r in again), again))

    if containers(args.project, "nats-2"):  # started with compose/nats-cluster.yml
        cluster = nats_cluster_loses_its_leader(args.project, args.url, args.requests)
        checks.append(("NATS cluster: 3 members, profiles bucket at 3 copies",
                       cluster["cluster_size"] == 3 and cluster["bucket_replicas"].get("KV_smartgen_profiles") == 3,
                       cluster))
        checks.append(("NATS cluster: with the JetStream leader stopped, requests complete and profiles read",
                       all(r["text"] == same[r["route"]] for r in cluster["replies_without_it"])
                       and cluster["profiles_readable"], cluster["stopped_leader"]))

    for name, passed, _ in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{"check": n, "passed": p, "evidence": e} for n, p, e in checks], out, indent=1)
    return 0 if all(p for _, p, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
