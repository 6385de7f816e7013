"""Migration under failure_policy `recompute` past the greedy, ignore_eos case: a decode worker that dies after the
answer's last token but before its final event costs the client nothing (the gateway completes the answer); a
seeded, sampled stream with a stop string and logprobs outlives two decode workers killed one after the other, with
the tokens, text and log-probabilities of a run that lost none."""
from __future__ import annotations

import asyncio
import os
import signal

import nats
import pytest

from schemas import Accepted, ErrorCode, ErrorReply, Generate, TokenEvent, WorkerInfo, decode, encode, subjects
from services.gateway.completion import CompletionRun
from services.gateway.requests import CompletionJob
from shared.runtime.registry import WorkerRegistry
from shared.runtime.rpc import ERROR_CODE_HEADER, ERROR_HEADER
from tools.client import get_json, list_workers, open_stream
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import assert_no_leaks, post_json

TTL_S = 0.6


class FakeDecode:
    """A decode worker on the wire (heartbeats, `generate`): streams `max_tokens` token events and then dies
    before its final event; or (`refuses`) answers every `generate` as a real one does a resume of a finished
    answer (services/decode/request.py `generate_problem`)."""

    def __init__(self, nc, worker_id: str, refuses: bool = False):
        self.nc, self.worker_id, self.refuses = nc, worker_id, refuses
        self.alive, self.holding, self.asked = True, [], 0

    async def start(self) -> None:
        await self.nc.subscribe(subjects.worker("decode", self.worker_id, "generate"), cb=self.generate)
        self.beats = asyncio.create_task(self.heartbeats())

    async def heartbeats(self) -> None:
        while self.alive:
            info = WorkerInfo("decode", self.worker_id, 1, "h", "", "v", max_requests=4, request_ids=list(self.holding))
            await self.nc.publish(subjects.heartbeat("decode"), encode(info))
            await asyncio.sleep(0.1)

    async def generate(self, msg) -> None:
        req, self.asked = decode(Generate, msg.data), self.asked + 1
        if self.refuses:
            error = ErrorReply(ErrorCode.BAD_REQUEST, "resume_tokens: nothing is left to generate")
            await self.nc.publish(msg.reply, encode(error), headers={ERROR_HEADER: error.message,
                                                                      ERROR_CODE_HEADER: error.code})
            return
        self.holding.append(req.request_id)
        await msg.respond(encode(Accepted(req.request_id, self.worker_id)))
        for index in range(req.max_tokens):
            await self.nc.publish(req.stream_subject, encode(TokenEvent(req.request_id, index, 100 + index)))
        await self.nc.flush()
        self.alive = False  # dies here: the last token is out, the final event never will be


async def test_a_decode_worker_lost_after_the_last_token_completes_the_answer(nats_server):
    """The decode worker streams every token of the answer, then dies before its final event: the client gets the
    whole answer with finish_reason length, and no other decode worker is asked to resume what is finished."""
    nc = await nats.connect(**nats_server.connect_options(), max_reconnect_attempts=0)
    try:
        dying, spare = FakeDecode(nc, "decode-a"), FakeDecode(nc, "decode-b", refuses=True)
        await dying.start()
        await spare.start()
        registry = WorkerRegistry(TTL_S)
        await registry.follow(nc, "gateway-test")
        await asyncio.sleep(0.3)  # both heartbeats heard
        job = CompletionJob("r1", "completion", [1, 2, 3], 12, 0.0, 0, [], True, "colocated", None, None,
                            failure_policy="recompute")
        run = CompletionRun(nc, registry, job, [2], 30.0, "gateway-test")
        tokens = await asyncio.wait_for(_collect(run), 10)
        await run.close()
        assert tokens == [100 + i for i in range(12)] and run.finish_reason == "length"
        assert spare.asked == 0 and run.migrated_from == []
    finally:
        await nc.close()


async def _collect(run: CompletionRun) -> list[int]:
    return [token async for token in run.tokens()]


@pytest.fixture
def three_decoders(tiny_model_path, tmp_path):
    spec = StackSpec(model=str(tiny_model_path), num_decode=3, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2"})
    with started_stack(spec, 180, may_die={"decode-0", "decode-1", "decode-2"}) as stack:
        yield stack


def test_a_sampled_stream_with_a_stop_string_and_logprobs_outlives_two_decode_workers(three_decoders):
    """temperature 0.9 with a seed, logprobs 2 and a stop string that ends the answer late; the decode worker
    streaming it is killed at token 15, the one it moved to at token 45: the client sees one stream with the
    text, tokens and log-probabilities of the same request run colocated without a failure, and both lost
    workers are named."""
    stack = three_decoders
    url = stack.gateway_url
    body = {"prompt": "Tell me a long story about a river city. " * 4, "max_tokens": 120, "temperature": 0.9,
            "seed": 1234, "logprobs": 2, "ignore_eos": True, "transfer_mode": "full", "failure_policy": "recompute"}
    _, unstopped = post_json(url + "/v1/completions", body | {"transfer_mode": "colocated"})
    text = unstopped["choices"][0]["text"]
    stop = text[len(text) * 3 // 4:][:6]  # a piece of the last quarter: the stop string ends the answer there
    assert stop and text.index(stop) > len(text) // 2
    body["stop"] = [stop]
    _, reference = post_json(url + "/v1/completions", body | {"transfer_mode": "colocated"})
    choice = reference["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[:text.index(stop)]

    pieces, logprobs, final, finish, killed = [], [], None, None, []
    with open_stream(url + "/v1/completions", body | {"stream": True}, timeout=120) as events:
        for payload in events:
            if not isinstance(payload, dict):
                break
            assert "error" not in payload, payload["error"]
            for c in payload["choices"]:
                pieces.append(c["text"])
                if c.get("logprobs"):
                    logprobs += c["logprobs"]["token_logprobs"]
                finish = c.get("finish_reason") or finish
            final = payload.get("smartgen", final)
            if len(pieces) in (15, 45) and len(killed) < (1 if len(pieces) == 15 else 2):
                serving = next(w for w in list_workers(url, stack.admin_token)
                               if w["role"] == "decode" and get_json(w["admin_url"] + "/stats")["active_requests"])
                os.kill(serving["pid"], signal.SIGKILL)
                killed.append(serving["id"])
    assert len(killed) == 2, "the stream ended before both kills"
    assert finish == "stop" and "".join(pieces) == choice["text"]
    assert final["resumed_from"] == killed and final["recomputed"]
    assert final["token_ids"] == reference["smartgen"]["token_ids"]
    assert logprobs == pytest.approx(choice["logprobs"]["token_logprobs"][:len(logprobs)], abs=1e-3)
    assert len(logprobs) >= len(choice["logprobs"]["token_logprobs"]) - 1
    assert_no_leaks(stack)
