"""Large results never ride one NATS message past its limit (#35): at 8K prompt tokens, `echo` with `logprobs` 20
would put ~8,000 × 20 alternatives in the prefill's one reply (past NATS's 1 MB max_payload), so the gateway
refuses it at once with a 400 that names `echo` and the limit; with `logprobs` 5 the same prompt's log-probabilities
fit, and come back, one per prompt token after the first, on both modes' paths (colocated: the decode worker's
reply; full: the prefill's)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.conftest import post_json
from tools.tiny_model import make_tiny_model

PROMPT_TOKENS = 8000


@pytest.fixture(scope="module")
def stack_8k(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path):
    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack

    folder = tmp_path_factory.mktemp("large-results")
    model = make_tiny_model(folder / "tiny-8k", tokenizer_from=real_model_path, max_positions=8192)
    spec = StackSpec(model=str(model), gateway_port=free_port(), log_file=folder / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1"})
    with started_stack(spec, 120) as stack:
        yield stack


def _prompt_of(tokens: int) -> list[int]:
    return [1000 + i % 5000 for i in range(tokens)]  # token ids: exactly `tokens` prompt tokens


def test_echo_with_many_logprobs_at_8k_is_refused_at_once_naming_the_limit(stack_8k):
    started = time.monotonic()
    status, body = post_json(stack_8k.gateway_url + "/v1/completions",
                             {"prompt": _prompt_of(PROMPT_TOKENS), "max_tokens": 1, "echo": True, "logprobs": 20})
    assert status == 400 and body["error"]["param"] == "echo", body
    assert "max_payload" in body["error"]["message"] and str(PROMPT_TOKENS) in body["error"]["message"], body
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("mode", ["colocated", "full"])
def test_echo_with_few_logprobs_at_8k_comes_back_whole(stack_8k, mode):
    status, body = post_json(stack_8k.gateway_url + "/v1/completions",
                             {"prompt": _prompt_of(PROMPT_TOKENS), "max_tokens": 2, "echo": True, "logprobs": 5,
                              "temperature": 0, "ignore_eos": True, "transfer_mode": mode}, timeout=300)
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == PROMPT_TOKENS + 2  # every prompt token, then the two generated
    assert logprobs["token_logprobs"][0] is None and all(v is not None for v in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None and all(0 < len(top) <= 5 for top in logprobs["top_logprobs"][1:])
