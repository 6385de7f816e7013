"""The real SmolLM2 through the whole disaggregated path, on a prompt of over 1,000 tokens."""
from __future__ import annotations

import pytest

from shared.nats_server import free_port
from shared.stack import Stack, StackSpec
from tests.integration.conftest import assert_no_leaks, post_json
from tests.reference import greedy_tokens, prompt_ids

NUM_TOKENS = 12


def long_prompt() -> str:
    """Real text of about 1,300 tokens: a stdlib module's source, then a question about it."""
    import inspect
    import textwrap

    source = inspect.getsource(textwrap)[:5200]
    return f"{source}\n\n# Question: what does the function `dedent` above do?\n# Answer:"


@pytest.mark.real_model
def test_real_model_full_and_colocated_match_generate(real_model_path, tmp_path):
    """Greedy SmolLM2 over >1,000 prompt tokens: full and colocated both give model.generate's tokens."""
    prompt = long_prompt()
    ids = prompt_ids(real_model_path, prompt)
    assert len(ids) >= 1000
    expected = greedy_tokens(real_model_path, ids, NUM_TOKENS)
    log_file = tmp_path / "stack.log"
    spec = StackSpec(gateway_port=free_port(), log_file=log_file, env={"SMARTGEN_KV_CACHE_MB": "256"})
    with Stack(spec) as stack:
        try:
            stack.wait_ready(240)
            for mode in ("full", "colocated"):
                status, body = post_json(stack.gateway_url + "/v1/completions",
                                         {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
                                          "transfer_mode": mode}, timeout=300)
                assert status == 200, body
                sg = body["smartgen"]
                print(f"{mode}: prompt {sg['prompt_tokens']} tokens, TTFT {sg['ttft_s']:.3f} s, "
                      f"TTST {sg['ttst_s']:.3f} s, TBT {sg['tbt_s']:.3f} s, kv_bytes {sg['kv_bytes']}")
                assert sg["token_ids"] == expected, mode
            assert_no_leaks(stack)
        except BaseException:
            print(log_file.read_text()[-4000:])
            raise
