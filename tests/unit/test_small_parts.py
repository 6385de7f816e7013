"""Pure logic: latency figures, metrics text, config loading, text streaming with stop strings."""
from __future__ import annotations

import pytest

from shared.runtime.config import ConfigError, ModelWorkerConfig, load_config
from shared.runtime.metrics import Registry
from shared.runtime.timeline import Timeline, ctl


def test_timeline_of_a_known_stream():
    """TTFT = t1, TTST = t2 - t1, TBT = mean of later gaps, CTL(i) = t_i."""
    t = Timeline.of([1.0, 3.0, 3.5, 4.0, 5.0])
    assert (t.ttft_s, t.ttst_s) == (1.0, 2.0)
    assert t.tbt_s == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert ctl([1.0, 3.0, 3.5], 2) == 3.0


def test_timeline_of_short_streams_and_bad_input():
    """One token has no TTST; decreasing times are an error."""
    assert Timeline.of([0.2]) == Timeline(0.2, None, None)
    assert Timeline.of([]) == Timeline(None, None, None)
    with pytest.raises(ValueError):
        Timeline.of([2.0, 1.0])


def test_histogram_renders_cumulative_buckets():
    """Prometheus histogram lines are cumulative and end with +Inf, sum and count."""
    reg = Registry()
    h = reg.histogram("x_seconds", "help", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    c = reg.counter("y_total", "help", ["path"])
    c.inc(3, path="full")
    text = reg.render()
    assert 'x_seconds_bucket{le="0.1"} 1.0' in text and 'x_seconds_bucket{le="1.0"} 2.0' in text
    assert 'x_seconds_bucket{le="+Inf"} 3.0' in text and "x_seconds_count 3.0" in text
    assert 'y_total{path="full"} 3.0' in text
    assert c.value(path="full") == 3 and c.by_first_label() == {"full": 3.0}


def test_metric_labels_are_escaped_and_process_metrics_exported():
    """A label value with quotes, a backslash or a newline stays one valid line; the process collector's
    metrics are there (on Linux)."""
    reg = Registry()
    reg.histogram("lat_seconds", "help", ["model_name"]).observe(0.2, model_name='my "model"\\n\nx')
    text = reg.render()
    assert 'model_name="my \\"model\\"\\\\n\\nx"' in text
    assert "process_cpu_seconds_total" in text


def test_config_flags_beat_env_beat_defaults():
    """--flag over SMARTGEN_* over the default, with types converted."""
    env = {"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_PAGE_TOKENS": "32"}
    cfg = load_config(ModelWorkerConfig, ["--page-tokens", "8"], env)
    assert (cfg.kv_cache_mb, cfg.page_tokens, cfg.device) == (64, 8, "cpu")


def test_config_errors_say_how_to_fix():
    """A bad value is a ConfigError naming the setting."""
    with pytest.raises(ConfigError, match="SMARTGEN_KV_CACHE_MB"):
        load_config(ModelWorkerConfig, [], {"SMARTGEN_KV_CACHE_MB": "lots"})
    with pytest.raises(ConfigError, match="transport"):
        load_config(ModelWorkerConfig, ["--transport", "pigeon"], {})


def test_text_stream_holds_back_a_possible_stop_string(tiny_model_path):
    """Text that might start a stop string is held until it is known not to; a stop cuts before it."""
    from transformers import AutoTokenizer

    from services.gateway.textstream import TextStream

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tok("Hello world, this is the end. More")["input_ids"]
    stream = TextStream(tok, stop=["the end"])
    out = "".join(stream.add(i) for i in ids) + stream.flush()
    assert stream.is_stopped and out == "Hello world, this is "
    free = TextStream(tok, stop=[])
    assert "".join(free.add(i) for i in ids) + free.flush() == "Hello world, this is the end. More"


def test_worker_id_must_fit_in_a_subject():
    """A worker id with a dot or space would break its NATS subjects: refused with the reason."""
    with pytest.raises(ConfigError, match="worker_id"):
        load_config(ModelWorkerConfig, ["--worker-id", "decode.1"], {})
    assert load_config(ModelWorkerConfig, ["--worker-id", "decode-1"], {}).worker_id == "decode-1"


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    """probabilities 0.4, 0.3, 0.2, 0.1 (at temperature 1): top_k 2 and top_p 0.5 (the nucleus: 0.4 does not reach
    0.5, 0.4 + 0.3 does) both sample tokens 0 and 1 only, and both of them; top_k 1 or a tiny top_p is greedy, even
    a top_p too small for float32 (schemathesis sent 5e-324, and every probability went to NaN)."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import sample

    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    def drawn(**kw) -> set[int]:
        return {sample(logits, Sampling(1.0, seed=seed, **kw), 0) for seed in range(200)}
    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_k=2) == drawn(top_p=0.5) == {0, 1}
    assert drawn(top_p=0.75) == {0, 1, 2}
    assert drawn(top_k=1) == drawn(top_p=0.01) == {0}
    assert drawn(top_p=5e-324) == {0}  # below float32's smallest value it rounds to 0; the first token stays (fuzz)
    assert drawn(top_k=4) == drawn(top_p=1.0) == drawn(top_k=10) == {0, 1, 2, 3}


def test_sampling_draws_each_token_as_often_as_its_probability():
    """The draw (the inverse of the cumulative distribution, seeded by (seed, index)) follows the softmax: over 20,000
    seeds each token's share is within 0.015 of its probability, a token of probability 0 never comes out, and the
    same (seed, index) always draws the same token; another index draws afresh."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import sample

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), -3.0])
    probs = torch.softmax(logits, dim=-1)
    counts = torch.bincount(torch.tensor([sample(logits, Sampling(1.0, seed=s), 0) for s in range(20_000)]),
                            minlength=6)
    assert counts[4] == 0
    assert torch.allclose(counts / 20_000, probs, atol=0.015)
    assert [sample(logits, Sampling(1.0, seed=7), 3) for _ in range(3)] == [sample(logits, Sampling(1.0, seed=7), 3)] * 3
    assert len({sample(logits, Sampling(1.0, seed=7), i) for i in range(50)}) > 1


def test_penalties_follow_openai_and_vllm():
    """repetition_penalty divides the positive logits and multiplies the negative ones of every token seen in the
    prompt or completion; presence subtracts once and frequency per occurrence, over the completion only; the
    greedy choice follows the penalized logits."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import penalized, sample

    logits = torch.tensor([2.0, -1.0, 1.5, 0.5])
    out = penalized(logits, Sampling(repetition_penalty=2.0), prompt=[1], completion=[0])
    assert out.tolist() == [1.0, -2.0, 1.5, 0.5]
    out = penalized(logits, Sampling(presence_penalty=0.5, frequency_penalty=0.25), prompt=[2], completion=[0, 0, 3])
    assert out.tolist() == [2.0 - 0.5 - 0.5, -1.0, 1.5, 0.5 - 0.5 - 0.25]
    assert sample(logits, Sampling(), 2, completion=[0, 0]) == 0
    assert sample(logits, Sampling(frequency_penalty=0.3), 2, completion=[0, 0]) == 2  # 2 − 0.6 < 1.5
    assert sample(logits, Sampling(frequency_penalty=0.3), 1, completion=[0, 0]) == 0  # tokens 0…index-1 only: 1.7
    assert sample(logits, Sampling(repetition_penalty=2.0), 0, prompt=[0]) == 2


def test_logit_bias_is_added_before_sampling():
    """logit_bias adds to the named tokens' logits, after the penalties: −100 bans the greedy choice, +100 forces a
    token at any temperature; the raw logits are left as they were (logprobs report the model's own)."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import biased, sample

    logits = torch.tensor([2.0, -1.0, 1.5, 0.5])
    assert biased(logits, {"0": -100.0, "3": 1.0}).tolist() == [-98.0, -1.0, 1.5, 1.5]
    assert logits.tolist() == [2.0, -1.0, 1.5, 0.5]
    assert sample(logits, Sampling(logit_bias={"0": -100.0}), 0) == 2
    assert {sample(logits, Sampling(temperature=2.0, seed=s, logit_bias={"1": 100.0}), 0) for s in range(20)} == {1}
    assert sample(logits, Sampling(frequency_penalty=1.0, logit_bias={"0": 0.4}), 1, completion=[0]) == 2  # 2−1+0.4 < 1.5


def test_a_vanishing_temperature_samples_greedily():
    """A temperature so small that logits / T overflows (the API fuzz sent 2e-187) is its limit, greedy, not a
    NaN distribution that fails the request."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import sample

    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, Sampling(2e-187, seed=1), 0) == int(logits.argmax())
    assert 0 <= sample(logits, Sampling(0.7, seed=1), 0) < 100


def test_text_stream_matches_a_full_decode_and_costs_little_per_token(tiny_model_path):
    """Incremental detokenization gives the full decode's text, multi-byte characters included, and a stop string
    spanning many tokens is found where it ends; a token's work stays bounded as the answer grows (the stop check
    looks only at the new text and a stop string's length before it)."""
    import time

    from transformers import AutoTokenizer

    from services.gateway.textstream import TextStream

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = "Grüße aus Zürich — naïve café, 東京 and ✓ marks. " * 3 + "STOP here and more"
    ids = tok(text)["input_ids"]
    free = TextStream(tok, stop=[])
    assert "".join(free.add(i) for i in ids) + free.flush() == tok.decode(ids, skip_special_tokens=True)
    stopped = TextStream(tok, stop=["✓ marks. STOP"])
    out = "".join(stopped.add(i) for i in ids) + stopped.flush()
    assert stopped.is_stopped and out == text[: text.index("✓ marks. STOP")]
    long_ids = tok("word " * 4000)["input_ids"]
    stream = TextStream(tok, stop=["x" * 256, "never"])
    started = time.perf_counter()
    for i in long_ids[:200]:
        stream.add(i)
    early = time.perf_counter() - started
    for i in long_ids[200:-200]:
        stream.add(i)
    started = time.perf_counter()
    for i in long_ids[-200:]:
        stream.add(i)
    late = time.perf_counter() - started
    assert late < 5 * early + 0.05, (early, late)  # O(n²) would make the last 200 tokens ~20× the first 200


async def test_a_stream_write_the_client_never_takes_ends_the_stream(monkeypatch):
    """A streaming client that reads nothing (its socket buffers full, the write never completes) is dropped after
    the write timeout, as a client that left (ConnectionResetError: the run aborts its workers and frees its slot)."""
    import asyncio

    from services.gateway import sse

    class StuckResponse:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()  # the transport never drains

    monkeypatch.setattr(sse, "WRITE_TIMEOUT_S", 0.05)
    with pytest.raises(ConnectionResetError, match="took no data"):
        await sse._send(StuckResponse(), {"choices": []})  # type: ignore[arg-type]


def test_min_p_and_min_tokens_follow_vllm():
    """min_p drops the tokens less likely than min_p × the most likely (0.4, 0.3, 0.2, 0.1 at min_p 0.6: 0.24 is the
    bar, so tokens 0 and 1 stay); min_tokens holds the end ids off while fewer tokens were generated, greedy or not,
    and lets them be chosen from that index on."""
    import torch

    from schemas import Sampling
    from shared.compute.sampling import sample

    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert {sample(logits, Sampling(1.0, seed=s, min_p=0.6), 0) for s in range(200)} == {0, 1}
    assert {sample(logits, Sampling(1.0, seed=s, min_p=0.0), 0) for s in range(200)} == {0, 1, 2, 3}
    early = Sampling(0.0, min_tokens=3, end_ids=[0])
    assert [sample(logits, early, i) for i in range(5)] == [1, 1, 1, 0, 0]  # token 0 (the end) only from index 3
    assert all(sample(logits, Sampling(1.0, seed=s, min_tokens=2, end_ids=[0, 1]), 1) in (2, 3) for s in range(50))


def test_request_fields_vllm_users_send_are_honoured_or_refused(tiny_model_path):
    """min_p, min_tokens, stop_token_ids and include_stop_str_in_output are parsed into the job; a bad value of
    each is a 400 naming it; a matched stop string stays in the text with include_stop_str_in_output."""
    from transformers import AutoTokenizer

    from services.gateway.requests import ApiError, parse_job
    from services.gateway.textstream import TextStream

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    base = {"model": "m", "prompt": "Hello", "max_tokens": 8}
    job = parse_job({**base, "min_p": 0.05, "min_tokens": 4, "stop_token_ids": [7, 3, 7],
                     "include_stop_str_in_output": True}, "completion", tok, 256, "m", "full", 16)
    assert (job.min_p, job.min_tokens, job.stop_token_ids, job.include_stop_str_in_output) == (0.05, 4, [3, 7], True)
    for field, value in (("min_p", 1.5), ("min_tokens", 9), ("min_tokens", -1), ("stop_token_ids", [len(tok)]),
                         ("stop_token_ids", "7"), ("include_stop_str_in_output", "yes")):
        with pytest.raises(ApiError) as caught:
            parse_job({**base, field: value}, "completion", tok, 256, "m", "full", 16)
        assert caught.value.param == field, (field, value)
    ids = tok("Hello world, this is the end. More")["input_ids"]
    stream = TextStream(tok, stop=["the end"], include_stop=True)
    assert "".join(stream.add(i) for i in ids) + stream.flush() == "Hello world, this is the end"


def test_a_request_that_names_no_selector_gets_the_default_of_its_prompts_length(tiny_model_path):
    """Below SELECTIVE_DEFAULTS' long row: HATA at 20% and K8V8 records; from it: keycodes at 10% with 4-bit values.
    What the request names wins field by field (a named HATA on a long prompt keeps its own 20%), and a gateway
    configured with a default selector uses it at every length."""
    from transformers import AutoTokenizer

    from schemas import DEFAULT_KV_BUDGET, SELECTIVE_DEFAULTS
    from services.gateway.requests import parse_job

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    long_row = SELECTIVE_DEFAULTS[-1]
    short, long = [3] * 100, [3] * long_row.from_tokens

    def job(prompt, default_selector="", **body):
        return parse_job({"prompt": prompt, "max_tokens": 4, "transfer_mode": "smartgen", **body}, "completion", tok,
                         8192, "m", "full", 16, default_selector)

    picked = lambda j: (j.selector, j.kv_budget, j.kv_bits)  # noqa: E731
    assert picked(job(short)) == ("hata", DEFAULT_KV_BUDGET, 8)
    assert picked(job(long)) == ("keycodes", 0.1, 4) == (long_row.selector, long_row.kv_budget, long_row.push_bits)
    assert picked(job(long, selector="hata")) == ("hata", DEFAULT_KV_BUDGET, 4)
    assert picked(job(long, kv_bits=8, kv_budget=0.3)) == ("keycodes", 0.3, 8)
    assert picked(job(long, default_selector="quest")) == ("quest", DEFAULT_KV_BUDGET, 4)
    quantized = parse_job({"prompt": long, "max_tokens": 4, "transfer_mode": "quantized"}, "completion", tok, 8192, "m",
                          "full", 16)
    assert (quantized.selector, quantized.kv_bits) == (None, 4)
