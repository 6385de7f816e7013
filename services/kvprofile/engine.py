"""Calibration: run a selector over calibration prompts and count how often it picks each relative block of
each layer (the paper's offline profiling). Synchronous torch; the model loads on the first build.

Each prompt is prefilled, then decoded greedily for `decode_steps` tokens with the selector active; the
counts of selected tokens per (layer, relative block) over the counts offered give I[layer, block]. Blocks
no calibration prompt covered (prompts shorter than M tokens leave gaps) take their neighbours' values.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from schemas import Sampling
from shared.runtime import calibration
from shared.runtime.profiles import observed_importance, tokens_per_block

Progress = Callable[[int, int, str], None]  # (done, total, stage)


class ProfileBuilder:
    def __init__(self, model: str = "", device: str = "cpu", dtype: str = "auto", page_tokens: int = 16,
                 torch_threads: int = 0, kv_dtype: str = "bfloat16"):
        self.model, self.device, self.dtype, self.page_tokens = model, device, dtype, page_tokens
        self.torch_threads, self.kv_dtype = torch_threads, kv_dtype
        self._engine = None
        self._tokenizer = None

    @property
    def model_name(self) -> str:
        return self.engine.runner.name

    @property
    def engine(self):
        """The decode engine this builder calibrates with (loaded once, on first use)."""
        if self._engine is None:
            from transformers import AutoTokenizer

            from shared.compute.decode_engine import DecodeEngine
            from shared.compute.kvstore import KvStore
            from shared.compute.modeling import ModelRunner, set_torch_threads
            from shared.runtime.models import resolve_model
            from shared.compute.selectors import default_prep_dir

            set_torch_threads(self.torch_threads)
            path: Path = resolve_model(self.model)
            runner = ModelRunner(path, self.device, self.dtype)
            # NOTE: KV kept in kv_dtype as the decode workers keep it, so calibration selects as serving does; the
            # store is sized per build (_fit_store)
            self._engine = DecodeEngine(runner, KvStore(runner.kv_layout(self.page_tokens, self.kv_dtype), 1),
                                        default_prep_dir(path))
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._engine

    def _fit_store(self, tokens: int) -> None:
        """Give the engine a KV store that holds one request of `tokens` tokens (a bigger one only when needed)."""
        from shared.compute.kvstore import KvStore

        store = self.engine.store
        if store.num_pages_total < _pages(tokens, store.layout.page_tokens):
            self.engine.store = KvStore(store.layout, _pages(tokens, store.layout.page_tokens))

    def prompts(self, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
        """Calibration prompts: multi-document QA (never used by an evaluation), else standard-library code."""
        engine = self.engine
        samples = calibration.hotpotqa_long(self._tokenizer, num_prompts, prompt_tokens, seed=7)
        if len(samples) < num_prompts:
            samples += calibration.lcc_stdlib(self._tokenizer, num_prompts - len(samples), prompt_tokens, seed=7)
        limit = engine.runner.max_positions - 1
        return [self._tokenizer(s.prompt)["input_ids"][-min(prompt_tokens, limit):] for s in samples[:num_prompts]]

    def build(self, selector: str, prompt_tokens: int, num_prompts: int, decode_steps: int, budget: float,
              num_blocks: int, on_progress: Progress | None = None) -> tuple[np.ndarray, int]:
        """I (num_layers, num_blocks) float32, and how many prompts it rests on."""
        engine = self.engine
        engine.selector(selector)  # fails early, with the fix, if it needs preparation
        prompts = self.prompts(num_prompts, prompt_tokens)
        self._fit_store(max(map(len, prompts)) + decode_steps)
        num_layers = engine.runner.num_layers
        selected = np.zeros((num_layers, num_blocks), dtype=np.float64)
        offered = np.zeros(num_blocks, dtype=np.float64)
        for i, ids in enumerate(prompts):
            if on_progress:
                on_progress(i, len(prompts), f"prompt {i + 1}/{len(prompts)}: {len(ids)} tokens")
            token = engine.prefill_local("calibration", ids, Sampling(), max_new_tokens=decode_steps)
            try:
                engine.use_selection("calibration", selector, budget, count_blocks=num_blocks)
                for step in range(1, decode_steps + 1):
                    token = engine.step("calibration", token, Sampling(), step)
            finally:
                sel = engine.end("calibration")
            assert sel is not None and sel.block_counts is not None
            selected += sel.block_counts
            offered += tokens_per_block(len(ids), num_blocks) * sel.num_sparse_steps * engine.runner.num_kv_heads
        if on_progress:
            on_progress(len(prompts), len(prompts), "done")
        obs, seen = observed_importance(selected.astype(np.float32), offered.astype(np.float32))
        return fill_gaps(obs, seen), len(prompts)


def _pages(tokens: int, page_tokens: int) -> int:
    return -(-tokens // page_tokens)


def fill_gaps(importance: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Blocks no prompt covered take the value interpolated between the nearest covered ones."""
    if seen.all() or not seen.any():
        return importance
    x = np.flatnonzero(seen)
    out = importance.copy()
    for layer in range(importance.shape[0]):
        out[layer] = np.interp(np.arange(importance.shape[1]), x, importance[layer, x])
    return out.astype(np.float32)
