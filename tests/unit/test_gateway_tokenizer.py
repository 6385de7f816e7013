"""The gateway's tokenizer (shared/runtime/models.py load_tokenizer): the class AutoTokenizer picks, the same ids and
chat prompts, and a gateway process that never imports torch (it costs ~1.7 s of CPU and ~200 MB per start)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from shared.runtime.models import load_tokenizer, model_config
from tools.stack import REPO_ROOT

TEXTS = ["Hello world", "  leading spaces and ünïcödé — dashes", "def f(x):\n    return {'a': x}\n", "<|im_start|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, blue, yellow."}, {"role": "user", "content": "And secondary?"}]


@pytest.mark.parametrize("which", ["real", "tiny"])
def test_the_tokenizer_is_autotokenizers(real_model_path, tiny_model_path, which):
    path = real_model_path if which == "real" else tiny_model_path
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
        assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    for generation_prompt in (True, False):
        assert (ours.apply_chat_template(CHAT, add_generation_prompt=generation_prompt, tokenize=False)
                == auto.apply_chat_template(CHAT, add_generation_prompt=generation_prompt, tokenize=False))
    assert ours.eos_token_id == auto.eos_token_id


def test_model_config_reads_what_autoconfig_reads(real_model_path, tmp_path):
    from transformers import AutoConfig

    assert model_config(real_model_path)["max_position_embeddings"] == AutoConfig.from_pretrained(
        real_model_path).max_position_embeddings
    assert model_config(tmp_path, "generation_config.json") == {}


def test_the_gateway_never_imports_torch(real_model_path):
    code = ("import sys; import services.gateway.service; from shared.runtime.models import load_tokenizer; "
            f"load_tokenizer({str(real_model_path)!r}); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", "the gateway's imports reached torch"
