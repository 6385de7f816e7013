"""Past one NATS server: the whole stack on a three-node NATS cluster (JetStream, the profiles bucket at three
replicas) rides out the loss of the server a worker is connected to, mid-stream, and of the JetStream meta
leader; two stacks share one NATS server in namespaces of their own without hearing each other; and routes over
compose's TLS settings join members of one CA and refuse another's."""
from __future__ import annotations

import time
from pathlib import Path

from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, get_json
from tools.client import DONE, Gateway, open_stream
from tools.nats_server import NatsCluster, NatsServer, free_port
from tools.stack import StackSpec, started_stack

ROUTE_TLS = Path(__file__).resolve().parents[2] / "compose" / "nats-route-tls.conf"
PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 8
BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "transfer_mode": "smartgen",
        "selector": "quest", "kv_budget": 0.25}


def connection_names(server: NatsServer) -> set[str]:
    """The client names (worker ids) connected to `server` now."""
    conns = get_json(f"http://127.0.0.1:{server.monitor_port}/connz", timeout=5)["connections"] or []
    return {c.get("name", "") for c in conns}


def meta_leader(cluster: NatsCluster) -> NatsServer:
    """The server that leads JetStream's meta group now (by its monitoring endpoint)."""
    for server in cluster.servers:
        if server.process is not None and server.process.poll() is None:
            leader = get_json(f"http://127.0.0.1:{server.monitor_port}/jsz", timeout=5).get("meta_cluster", {}).get("leader")
            if leader:
                return next(s for s in cluster.servers if s.args[s.args.index("-n") + 1] == leader)
    raise AssertionError("no JetStream meta leader")


def wait_until_profiles_answer(gateway: Gateway, timeout_s: float) -> None:
    """Until kvprofile is registered and its bucket open (GET /profiles answers 200)."""
    deadline = time.monotonic() + timeout_s
    while True:
        url = gateway.kvprofile_url()
        if url is not None and "_status" not in get_json(url + "/profiles", timeout=10):
            return
        assert time.monotonic() < deadline, "kvprofile never opened its bucket"
        time.sleep(0.2)


def stream_through(url: str, during) -> list[int]:
    """Stream BODY; after its 5th token run `during()`, then read the stream to its end. The token ids of the
    final chunk; AssertionError if the stream broke or ended early."""
    final = None
    with open_stream(url + "/v1/completions", BODY, timeout=120) as events:
        for i, event in enumerate(events):
            if event == DONE:
                break
            assert "error" not in event, event["error"]
            if i == 5:
                during()
            final = event.get("smartgen", final)
    assert final is not None, "the stream ended without its final chunk"
    return final["token_ids"]


def test_the_stack_rides_out_losing_nats_servers(tiny_model_path: Path, tmp_path: Path):
    """SMARTGEN_NATS_URL names three clustered servers. Killing the server the decode worker is connected to in
    the middle of a stream: the stream completes with every token (events the dead server had not delivered are
    asked for again), the decode worker reconnects to another server. Restarted, then the JetStream meta leader killed: the profile kvprofile
    stored at three replicas is still readable, and a stream completes."""
    with NatsCluster(3) as cluster:
        spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), nats_url=cluster.url,
                         log_file=tmp_path / "stack.log",
                         env={**cluster.client_env(), "SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_BUCKET_REPLICAS": "3",
                              **NO_FLOOR_ENV})
        with started_stack(spec, 180) as stack:
            gateway = Gateway(stack.gateway_url, stack.admin_token)
            # NOTE: kvprofile creates its bucket at three replicas first, which a fresh cluster may take seconds to
            # do (its bucket routes answer 503 meanwhile): the stack serves without it, but this test needs it
            wait_until_profiles_answer(gateway, 60)
            first = gateway.stream(BODY, timeout=120)  # also has kvprofile store a profile (online update)
            assert len(first["token_ids"]) == 40
            decode_id = next(w["id"] for w in gateway.workers() if w["role"] == "decode")
            victim = next(s for s in cluster.servers if decode_id in connection_names(s))
            # NOTE: the gateway may be on it too (1 run in 3): then it reconnects as well, and asks for the token
            # events lost meanwhile again, like any others

            def kill_victim() -> None:
                victim.process.kill()
                victim.process.wait()

            assert stream_through(stack.gateway_url, kill_victim) == first["token_ids"], "every token, the same"
            deadline = time.monotonic() + 20
            while not any(decode_id in connection_names(s) for s in cluster.servers if s is not victim):
                assert time.monotonic() < deadline, "the decode worker did not reconnect to another server"
                time.sleep(0.2)
            victim.start()  # back in the cluster (same store), so losing one more server keeps a quorum

            kvprofile = gateway.kvprofile_url()
            deadline = time.monotonic() + 40
            keys: list[str] = []
            while not keys:  # NOTE: JetStream answers again once the restarted server has caught up
                try:
                    keys = [p["key"] for p in get_json(kvprofile + "/profiles", timeout=10).get("profiles", [])]
                except OSError:  # a 503 (HTTPError) while JetStream catches up, or no answer yet
                    pass
                assert keys or time.monotonic() < deadline, "no profile was stored, or the bucket stayed unreadable"
                time.sleep(0.5)
            leader = meta_leader(cluster)
            leader.process.kill()
            leader.process.wait()
            deadline = time.monotonic() + 30
            while True:  # a new meta leader is elected; the bucket's stream has replicas on the other servers
                try:
                    profile = get_json(kvprofile + f"/profiles/{keys[0]}", timeout=10)
                    if "importance" in profile:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the stored profile did not stay readable"
                time.sleep(0.5)
            after = gateway.stream(BODY, timeout=120)
            assert after["token_ids"] == first["token_ids"]
            assert_no_leaks(stack)


def test_two_stacks_share_one_nats_in_their_own_namespaces(tiny_model_path: Path, tmp_path: Path):
    """SMARTGEN_NAMESPACE puts a stack's subjects under smartgen.<namespace>. and its profiles in a bucket of its
    own: two stacks on one server each see only their own workers and each serves."""
    with NatsServer() as server:
        specs = [StackSpec(model=str(tiny_model_path), gateway_port=free_port(), nats_url=server.url,
                           log_file=tmp_path / f"{ns}.log",
                           env={**server.client_env(), "SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_NAMESPACE": ns})
                 for ns in ("team-a", "team-b")]
        with started_stack(specs[0], 180) as a, started_stack(specs[1], 180) as b:
            for stack in (a, b):
                workers = Gateway(stack.gateway_url, stack.admin_token).workers()
                assert sorted(w["role"] for w in workers) == ["broker", "decode", "gateway", "kvprofile", "prefill"], workers
                reply = Gateway(stack.gateway_url).complete({"prompt": "Hi there", "max_tokens": 3, "temperature": 0})
                assert len(reply["token_ids"]) == 3
            # NOTE: both stacks name their broker broker-0 (and kvprofile-0): the namespace keeps them apart
            seen_a = {w["admin_url"] for w in Gateway(a.gateway_url, a.admin_token).workers()}
            seen_b = {w["admin_url"] for w in Gateway(b.gateway_url, b.admin_token).workers()}
            assert not seen_a & seen_b
            buckets = {get_json(Gateway(s.gateway_url, s.admin_token).kvprofile_url() + "/stats")["bucket"] for s in (a, b)}
            assert buckets == {"smartgen_team-a_profiles", "smartgen_team-b_profiles"}


def route_tls_member(tmp_path: Path, name: str, route_ports: list[int], i: int, password: str) -> NatsServer:
    """A NATS member clustered over loopback routes that need `password` and run through compose's route TLS
    settings (compose/nats-route-tls.conf, included as compose/nats-cluster.conf does; its files from
    $NATS_ROUTE_TLS_*). No JetStream store of note: the routes are the point."""
    conf = tmp_path / f"{name}.conf"
    (tmp_path / "route-tls.conf").write_text(ROUTE_TLS.read_text())  # NOTE: nats-server includes beside the config
    routes = ", ".join(f"nats://route:{password}@127.0.0.1:{p}" for p in route_ports)
    conf.write_text(f"""cluster {{
  name: smartgen
  listen: 127.0.0.1:{route_ports[i]}
  authorization {{
    user: route
    password: $SMARTGEN_NATS_ROUTE_PASSWORD
  }}
  include ./route-tls.conf
  routes: [{routes}]
}}
""")
    return NatsServer(token="", args=["-n", name, "-c", str(conf)])


def routed_to(server: NatsServer) -> set[str]:
    """The server names `server` has a route to now (NOTE: nats-server pools several connections per peer)."""
    routes = get_json(f"http://127.0.0.1:{server.monitor_port}/routez", timeout=5)["routes"] or []
    return {r.get("remote_name", "") for r in routes}


def test_routes_over_tls_join_members_of_the_ca_and_refuse_a_stranger(tmp_path: Path, monkeypatch):
    """Two servers whose routes use compose's route TLS settings (certificates of one CA) and the route password
    form a cluster: a message published on one reaches a subscriber on the other. A third server with the right
    password but a certificate of another CA gets no route to them."""
    import asyncio

    import nats

    from tests.certificates import make_certificates

    (ours := tmp_path / "ca").mkdir()
    (theirs := tmp_path / "other-ca").mkdir()
    certs, strange = make_certificates(ours), make_certificates(theirs)
    route_ports = [free_port() for _ in range(3)]
    monkeypatch.setenv("SMARTGEN_NATS_ROUTE_PASSWORD", "route-pw")
    for name, path in (("CA", "ca.pem"), ("CERT", "peer.pem"), ("KEY", "peer.key")):
        monkeypatch.setenv(f"NATS_ROUTE_TLS_{name}", str(certs[path]))
    members = [route_tls_member(tmp_path, f"m{i}", route_ports[:2], i, "route-pw") for i in range(2)]
    with members[0], members[1]:
        deadline = time.monotonic() + 15
        while not (routed_to(members[0]) == {"m1"} and routed_to(members[1]) == {"m0"}):
            assert time.monotonic() < deadline, ("the two members did not route to each other over TLS: "
                                                 + members[0].log_path.read_text(errors="replace")[-1500:])
            time.sleep(0.2)

        async def across() -> bytes:
            sub_nc, pub_nc = await nats.connect(members[1].url), await nats.connect(members[0].url)
            try:
                sub = await sub_nc.subscribe("route.tls.check")
                await sub_nc.flush()
                for _ in range(50):  # NOTE: the interest crosses the route a moment after the flush
                    await pub_nc.publish("route.tls.check", b"over tls")
                    await pub_nc.flush()
                    try:
                        return (await sub.next_msg(timeout=0.2)).data
                    except nats.errors.TimeoutError:
                        continue
                raise AssertionError("no message crossed the route")
            finally:
                await sub_nc.close()
                await pub_nc.close()

        assert asyncio.run(across()) == b"over tls"
        for name, path in (("CA", "ca.pem"), ("CERT", "peer.pem"), ("KEY", "peer.key")):
            monkeypatch.setenv(f"NATS_ROUTE_TLS_{name}", str(strange[path]))
        with route_tls_member(tmp_path, "stranger", [route_ports[0], route_ports[2]], 1, "route-pw") as stranger:
            deadline = time.monotonic() + 15
            while "certificate" not in stranger.log_path.read_text(errors="replace"):  # refused at the TLS handshake
                assert time.monotonic() < deadline, "the stranger's route to m0 was not refused over its certificate"
                time.sleep(0.1)
            assert not routed_to(stranger) and routed_to(members[0]) == {"m1"}
