"""One real request through the whole disaggregated path: gateway → prefill → KV push → decode."""
from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from tests.integration.conftest import assert_no_leaks, get_json, list_workers, model_workers, post_json, post_sse
from tests.reference import greedy_tokens, prompt_ids, token_logprobs
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tools.tiny_model import make_tiny_model

PROMPT = "The history of the city begins with a small settlement on the river, where traders"


@pytest.mark.parametrize("mode", ["full", "colocated"])
def test_greedy_matches_model_generate(clean_stack, tiny_model_path, mode):
    """With temperature 0, the served tokens are exactly model.generate's, in both modes."""
    status, body = post_json(clean_stack.gateway_url + "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "transfer_mode": mode})
    assert status == 200, body
    expected = greedy_tokens(tiny_model_path, prompt_ids(tiny_model_path, PROMPT), 24)
    sg = body["smartgen"]
    assert sg["token_ids"] == expected
    assert sg["transfer_mode"] == mode
    assert body["usage"]["completion_tokens"] == len(expected)
    if mode == "full":
        assert sg["prefill_worker_id"] and sg["decode_worker_id"]
        assert sg["kv_bytes"]["full"] > 0
    else:
        assert sg["prefill_worker_id"] is None and sg["kv_bytes"] == {}


def test_full_mode_moves_every_layer(clean_stack, tiny_model_path):
    """The bytes that land on decode are exactly the prompt's KV that the decode worker lacks (all of it, less the
    pages its prefix cache had from an earlier request): tokens × layers × K,V × heads × dim."""
    n = len(prompt_ids(tiny_model_path, PROMPT))
    _, body = post_json(clean_stack.gateway_url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "transfer_mode": "full"})
    # tiny model: 4 layers, 2 KV heads, head dim 16, fp32
    assert body["smartgen"]["kv_bytes"]["full"] == (n - body["smartgen"]["decode_cached_tokens"]) * 4 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streaming_agrees_with_non_streaming(clean_stack, route):
    """SSE deltas add up to the non-streaming text; the last chunk carries smartgen timing that is consistent."""
    url = clean_stack.gateway_url + ("/v1/completions" if route == "completions" else "/v1/chat/completions")
    body = {"max_tokens": 12, "temperature": 0}
    body |= {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    status, whole = post_json(url, body)
    assert status == 200, whole
    chunks = post_sse(url, body)
    if route == "completions":
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert streamed == whole["choices"][0]["text"]
    else:
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert streamed == whole["choices"][0]["message"]["content"]
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    final = chunks[-1]
    sg = final["smartgen"]
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert sg["token_ids"] == whole["smartgen"]["token_ids"]
    times = sg["token_times_s"]
    assert len(times) == len(sg["token_ids"]) == final["usage"]["completion_tokens"]
    assert times == sorted(times) and times[0] > 0
    assert sg["ttft_s"] == pytest.approx(times[0], abs=1e-5)
    assert sg["ttst_s"] == pytest.approx(times[1] - times[0], abs=1e-5)
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    assert sg["tbt_s"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)


def test_stop_string_ends_the_completion(clean_stack, tiny_model_path):
    """A stop string cuts the text before it, finishes with 'stop', and frees the workers (leak check)."""
    _, free = post_json(clean_stack.gateway_url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "the reference text is too short to pick a stop string from"
    _, body = post_json(clean_stack.gateway_url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop]})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[: text.find(stop)]


def test_seeded_sampling_is_the_same_in_both_modes(clean_stack):
    """A sampled token depends on (seed, index, logits, top_p, top_k) only, so colocated and full agree (the
    prefill samples token 0, decode the rest); top_k 1 is greedy at any temperature, in both processes."""
    url = clean_stack.gateway_url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 1234, "top_p": 0.9, "top_k": 40,
            "ignore_eos": True}
    _, a = post_json(url, body | {"transfer_mode": "full"})
    _, b = post_json(url, body | {"transfer_mode": "colocated"})
    assert a["smartgen"]["token_ids"] == b["smartgen"]["token_ids"]
    _, greedy = post_json(url, body | {"temperature": 0, "transfer_mode": "full"})
    _, top1 = post_json(url, body | {"temperature": 1.5, "top_k": 1, "transfer_mode": "full"})
    assert top1["smartgen"]["token_ids"] == greedy["smartgen"]["token_ids"]
    penalized = body | {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    _, a = post_json(url, penalized | {"transfer_mode": "full"})
    _, b = post_json(url, penalized | {"transfer_mode": "colocated"})
    assert a["smartgen"]["token_ids"] == b["smartgen"]["token_ids"]
    # logit_bias reaches both processes: greedy's tokens 0 and 1 banned, then forced back by the other map
    first, second = greedy["smartgen"]["token_ids"][:2]
    banned = body | {"temperature": 0, "logit_bias": {str(first): -100, str(second): -100}}
    for mode in ("full", "colocated"):
        _, out = post_json(url, banned | {"transfer_mode": mode})
        assert first not in out["smartgen"]["token_ids"] and second not in out["smartgen"]["token_ids"], mode
    _, forced = post_json(url, body | {"temperature": 1.5, "logit_bias": {str(second): 100}, "transfer_mode": "full"})
    assert forced["smartgen"]["token_ids"] == [second] * 10


def test_concurrent_requests_all_complete(clean_stack):
    """Several requests at once on one decode worker each get their own correct stream."""
    import concurrent.futures

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    _, alone = post_json(clean_stack.gateway_url + "/v1/completions", body)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post_json(clean_stack.gateway_url + "/v1/completions", body), range(4)))
    assert all(status == 200 for status, _ in results)
    assert all(r["smartgen"]["token_ids"] == alone["smartgen"]["token_ids"] for _, r in results)


def test_concurrent_requests_step_together(clean_stack):
    """Continuous batching: requests of different prompts and transfer modes (dense and selective, with reads
    of remote KV) running at once on one decode worker share its forward passes, and each gets exactly the
    tokens it gets alone."""
    import concurrent.futures

    base = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    bodies = [base | {"prompt": PROMPT, "transfer_mode": "full"},
              base | {"prompt": PROMPT + " sold salt", "transfer_mode": "colocated"},
              base | {"prompt": "Once upon a time " * 6, "transfer_mode": "partial", "selector": "quest", "kv_budget": 0.3},
              base | {"prompt": PROMPT[::-1], "transfer_mode": "smartgen", "selector": "quest", "kv_budget": 0.25}]
    url = clean_stack.gateway_url + "/v1/completions"
    alone = [post_json(url, body)[1]["smartgen"]["token_ids"] for body in bodies]
    decode = next(w for w in model_workers(clean_stack) if w["role"] == "decode")
    before = get_json(decode["admin_url"] + "/stats")["batching"]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda body: post_json(url, body), bodies + bodies))
    after = get_json(decode["admin_url"] + "/stats")["batching"]
    assert all(status == 200 for status, _ in results), results
    assert [r["smartgen"]["token_ids"] for _, r in results] == alone + alone
    steps = 2 * len(bodies) * (base["max_tokens"] - 1)  # every step but the prefill's first token
    batches = after["batches"] - before["batches"]
    print(f"{steps} steps in {batches} forward passes")
    assert batches < 0.6 * steps  # steps shared forward passes (alone, each step is one pass)


@pytest.mark.parametrize("mode", ["full", "colocated"])
def test_logprobs_and_echo_match_transformers(clean_stack, tiny_model_path, mode):
    """completions with echo and logprobs (what lm-eval's loglikelihood tasks send): the text is prompt +
    completion, and every token's log-probability, prompt and completion alike, is plain transformers' within
    1e-4; the greedy tokens are their position's most likely; chat gives the same numbers in its own shape."""
    ids = prompt_ids(tiny_model_path, PROMPT)
    status, body = post_json(clean_stack.gateway_url + "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
                              "ignore_eos": True, "transfer_mode": mode})
    assert status == 200, body
    choice, out = body["choices"][0], body["smartgen"]["token_ids"]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(logprobs["tokens"]) == len(ids) + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = token_logprobs(tiny_model_path, ids + out)
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:], reference)) < 1e-4
    for text, top in zip(logprobs["tokens"][len(ids):], logprobs["top_logprobs"][len(ids):]):
        assert len(top) <= 2 and max(top, key=top.get) == text  # greedy: the most likely token
    assert logprobs["text_offset"][len(ids)] == len(PROMPT)

    status, chat = post_json(clean_stack.gateway_url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
                              "logprobs": True, "top_logprobs": 1, "transfer_mode": mode})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(chat["smartgen"]["token_ids"])
    assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)


def test_a_list_of_prompts_answers_one_choice_each(clean_stack, tiny_model_path):
    """completions with prompt as a list of texts (or of token-id lists): one choice per prompt, in order, each
    the tokens its prompt gets alone; usage summed."""
    url = clean_stack.gateway_url + "/v1/completions"
    prompts = [PROMPT, "Once upon a time", PROMPT + " and"]
    alone = [post_json(url, {"prompt": p, "max_tokens": 5, "temperature": 0})[1] for p in prompts]
    status, body = post_json(url, {"prompt": prompts, "max_tokens": 5, "temperature": 0})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    status, by_ids = post_json(url, {"prompt": [prompt_ids(tiny_model_path, p) for p in prompts], "max_tokens": 5,
                                     "temperature": 0})
    assert status == 200, by_ids
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in body["choices"]]


def test_n_answers_each_prompt_n_times(clean_stack):
    """n > 1, both routes: n choices per prompt (choice p·n + j), each sampled alone; with a seed, answer 0 is the
    n = 1 answer and answer j is the n = 1 answer with seed + j; a prompt's tokens count once in the usage."""
    from openai import OpenAI

    url = clean_stack.gateway_url + "/v1/completions"
    sampled = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    status, body = post_json(url, {"prompt": [PROMPT, "Once upon a time"], "n": 3, **sampled})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for p, prompt in enumerate([PROMPT, "Once upon a time"]):
        alone = [post_json(url, {"prompt": prompt, **sampled, "seed": 7 + j})[1] for j in range(3)]
        assert [c["smartgen"]["token_ids"] for c in body["choices"][3 * p: 3 * p + 3]] == \
            [a["smartgen"]["token_ids"] for a in alone]
    assert len({tuple(c["smartgen"]["token_ids"]) for c in body["choices"][:3]}) > 1  # the answers differ
    assert body["usage"]["prompt_tokens"] == sum(post_json(url, {"prompt": p, "max_tokens": 1})[1]["usage"]["prompt_tokens"]
                                                 for p in [PROMPT, "Once upon a time"])
    assert body["usage"]["completion_tokens"] == 36
    client = OpenAI(base_url=clean_stack.gateway_url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model=client.models.list().data[0].id, n=2, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


def test_openai_client_works(clean_stack):
    """The official openai client talks to the gateway, streaming and not."""
    from openai import OpenAI

    client = OpenAI(base_url=clean_stack.gateway_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    assert sum(1 for _ in stream) >= 1


def test_health_models_workers(clean_stack, tiny_model_path):
    """/health is ok with workers; /v1/models names the model; /workers lists every role with its contract fields."""
    assert get_json(clean_stack.gateway_url + "/health")["status"] == "ok"
    models = get_json(clean_stack.gateway_url + "/v1/models")
    assert models["data"][0]["id"] == tiny_model_path.name
    workers = list_workers(clean_stack.gateway_url, clean_stack.admin_token)
    assert {w["role"] for w in workers} == {"gateway", "prefill", "decode", "broker", "kvprofile"}
    for w in workers:
        assert {"role", "id", "pid", "host", "admin_url"} <= set(w)
        stats = get_json(w["admin_url"] + "/stats")
        assert stats["worker_id"] == w["id"]
        assert get_json(w["admin_url"] + "/health")["status"] == "ok"
        if w["role"] in ("prefill", "decode"):
            assert {"active_requests", "kv_pages_in_use", "kv_pages_total", "leases_open"} <= set(stats)
            assert stats["kv_pages_total"] > 0


def test_metrics_count_requests(clean_stack):
    """Gateway /metrics exposes the latency histograms and counts a finished request."""
    def count(text: str, name: str) -> float:  # summed over the label sets
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))

    import urllib.request

    read = lambda: urllib.request.urlopen(clean_stack.gateway_url + "/metrics").read().decode()  # noqa: E731
    before = read()
    post_json(clean_stack.gateway_url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    after = read()
    for name in ("smartgen_time_to_first_token_seconds", "smartgen_time_to_second_token_seconds",
                 "smartgen_inter_token_latency_seconds"):
        assert f"# TYPE {name} histogram" in after
    assert count(after, "smartgen_time_to_second_token_seconds_count") == count(before, "smartgen_time_to_second_token_seconds_count") + 1
    assert 'smartgen_kv_transfer_bytes_total{path="full"}' in after
    assert 'smartgen_time_to_first_token_seconds_count{model_name="' in after and 'transfer_mode="full"' in after
    assert count(after, "smartgen_generation_tokens_total") == count(before, "smartgen_generation_tokens_total") + 3
    assert count(after, "smartgen_requests_total") == count(before, "smartgen_requests_total") + 1
    assert "process_resident_memory_bytes" in after  # prometheus_client's process collector


async def test_every_service_answers_nats_micro(clean_stack):
    """$SRV.PING answers for all five services, with the role in the name."""
    nc = await nats.connect(**clean_stack.nats_options())
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.PING", b"", reply=inbox)
        names = set()
        deadline = asyncio.get_running_loop().time() + 2
        while asyncio.get_running_loop().time() < deadline and len(names) < 5:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            import json

            names.add(json.loads(msg.data)["name"])
        assert names == {f"smartgen-{r}" for r in ("gateway", "prefill", "decode", "kvprofile", "broker")}
    finally:
        await nc.close()


def test_natsctl_lists_the_services(clean_stack):
    """The NATS CLI stand-in shows every service and its endpoints."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tools.natsctl", "--server", clean_stack.nats_url, "micro", "ls"],
                         capture_output=True, text=True, timeout=30, check=True,
                         env={**os.environ, **clean_stack.client_env()}).stdout
    for role in ("gateway", "prefill", "decode", "kvprofile", "broker"):
        assert f"smartgen-{role}" in out
    assert ".decode-" in out and "smartgen.broker.broker-0.open" in out and "kvprofile-0.build" in out


@pytest.mark.parametrize("mode", ["full", "colocated"])
def test_selector_and_budget_reach_the_decode_worker(clean_stack, mode):
    """`selector`/`kv_budget` switch decode to selective attention: a full budget is exactly dense, a small one
    attends to a small share of the cache and says so."""
    url = clean_stack.gateway_url + "/v1/completions"
    body = {"prompt": PROMPT * 4, "max_tokens": 8, "temperature": 0, "transfer_mode": mode}
    _, dense = post_json(url, body)
    _, whole = post_json(url, body | {"selector": "oracle", "kv_budget": 1.0})
    assert whole["smartgen"]["token_ids"] == dense["smartgen"]["token_ids"]
    assert dense["smartgen"]["attention"] == "dense" and whole["smartgen"]["attention"] == "selective"
    status, small = post_json(url, body | {"selector": "quest", "kv_budget": 0.25})
    assert status == 200, small
    assert 0 < small["smartgen"]["selected_share"] < 0.5


@pytest.fixture(scope="module")
def unprepared_stack(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path):
    """A stack on a tiny model without the selectors' offline preparation (the shared tiny model has it)."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-unprepared"), tokenizer_from=real_model_path, prepare=False)
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=tmp_path_factory.mktemp("logs") / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1"})
    with started_stack(spec, 180) as running:
        yield running


def test_selector_needing_preparation_is_refused_with_the_fix(unprepared_stack):
    """infinigen or hata (the default selector) without its offline preparation for the served model: a 400 naming
    the command (hata never falls back to random projections unasked; `hata_untrained` asks for them)."""
    url = unprepared_stack.gateway_url + "/v1/completions"
    for body in ({"selector": "infinigen"}, {"selector": "hata"}, {"transfer_mode": "smartgen"}):
        status, reply = post_json(url, {"prompt": PROMPT, "max_tokens": 3, **body})
        assert status == 400 and "smartgen model prepare" in reply["error"]["message"], (body, reply)
    status, reply = post_json(url, {"prompt": PROMPT, "max_tokens": 3, "selector": "hata_untrained"})
    assert status == 200, reply
    assert_no_leaks(unprepared_stack)


def test_what_standard_clients_send(clean_stack):
    """The OpenAI SDK on both routes with what load generators send: chat content as text parts, a stream with
    stream_options.include_usage (a last chunk with no choices and the usage, one chunk per token before it),
    and an X-Request-Id that becomes the response's id and is echoed."""
    from openai import OpenAI

    client = OpenAI(base_url=clean_stack.gateway_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}], max_tokens=6,
        temperature=0, extra_headers={"X-Request-Id": "client-req-1"}, extra_body={"ignore_eos": True})
    assert raw.headers["X-Request-Id"] == "client-req-1" and raw.parse().id == "client-req-1"
    assert raw.parse().usage.completion_tokens == 6
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len([c for c in chunks if c.choices and c.choices[0].finish_reason is None]) == 6  # a chunk per token
    status, refused = post_json(clean_stack.gateway_url + "/v1/completions", {"prompt": PROMPT, "best_of": 2})
    assert status == 400 and refused["error"]["param"] == "best_of"


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405)])
def test_http_errors_have_json_bodies(clean_stack, method, path, status):
    """Routes that do not exist or do not take the method answer with an OpenAI-style JSON error too."""
    from tools.client import request

    reply = request(clean_stack.gateway_url + path, method=method)
    assert reply.status == status and reply.body["error"]["code"] == status
