"""`.creds` (NKey / JWT) authentication end to end: a NATS server in operator mode, the whole stack connecting
with SMARTGEN_NATS_CREDS (JetStream profiles included), and a client without the credentials refused."""
from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from tools.nats_server import NatsServer, free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import post_json
from tests.nats_jwt import write_operator_mode


@pytest.fixture(scope="module")
def operator_nats(tmp_path_factory: pytest.TempPathFactory):
    conf, creds = write_operator_mode(tmp_path_factory.mktemp("nats-operator"))
    with NatsServer(token="", args=["-c", str(conf)]) as server:
        yield server, creds


def test_the_stack_runs_on_creds_and_strangers_are_refused(operator_nats, tiny_model_path: Path, tmp_path: Path):
    server, creds = operator_nats
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), nats_url=server.url,
                     log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_NATS_CREDS": str(creds), "SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1"})
    with started_stack(spec, 180) as stack:
        for mode in ("colocated", "full"):
            status, body = post_json(stack.gateway_url + "/v1/completions",
                                     {"prompt": "Hello there", "max_tokens": 4, "transfer_mode": mode}, timeout=60)
            assert status == 200 and len(body["smartgen"]["token_ids"]) == 4, (mode, body)
    started = [line for line in spec.log_file.read_text().splitlines() if '"service_started"' in line]
    assert len(started) == 5 and all('"nats_auth": "creds"' in line for line in started)  # kvprofile's JetStream too

    async def connect(**options) -> None:
        nc = await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                                **options)
        await nc.close()

    asyncio.run(connect(user_credentials=str(creds)))
    with pytest.raises(Exception, match="Authorization Violation"):
        asyncio.run(connect())
