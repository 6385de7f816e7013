"""The model, computed: load once, prefill a prompt layer by layer, decode one token at a time.

Synchronous torch only (no asyncio): services run it on their one dedicated torch thread.
Works for any transformers causal LM whose decoder layers fill a DynamicCache (Llama, Qwen, …).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging
from transformers.cache_utils import DynamicCache

from schemas import KvLayout, TokenLogprobs
from shared.compute.kvstore import layout_for
from shared.compute.prefix_cache import LayerKv
from shared.compute.sampling import prompt_logprobs
from shared.compute.slab_cache import BatchCache, SlabCache

PROMPT_LOGITS_CHUNK = 256  # prompt positions whose logits are computed at once (prefill_scored)
# on_layer(layer, keys, values): keys/values (num_kv_heads, num_tokens, head_dim), called as each layer finishes.
LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


def set_torch_threads(threads: int) -> None:
    """0 = torch's default. Several model processes on one small machine want 1 each (docs/operations.md, "On small CPU machines")."""
    if threads > 0:
        torch.set_num_threads(threads)


class ModelRunner:
    def __init__(self, path: Path | str, device: str = "cpu", dtype: str = "auto"):
        hf_logging.disable_progress_bar()  # services log JSON lines, not progress bars
        self.device = torch.device(device)
        # NOTE: fp32 on CPU (bf16 is ~5× slower on these CPUs), bf16 on CUDA, unless told otherwise.
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.config = AutoConfig.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
        self.model.to(self.device).eval()
        self.dtype = torch_dtype
        self.path = Path(path)
        self.name = self.path.name
        self.num_layers = self.config.num_hidden_layers
        self.num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        self.max_positions = self.config.max_position_embeddings
        self.vocab_size = self.config.vocab_size
        _pad_small_batches(self.model.get_output_embeddings())
        # a decode step's rows are projected one by one (see _one_row_at_a_time); False: one shared matmul, faster
        # at B ≥ 2 but a row's rounding then depends on its batch
        self.batch_invariant = True
        for layer in self.model.get_decoder().layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    _one_row_at_a_time(module, self)

    def token_problem(self, token_ids: list[int]) -> str:
        """Why these prompt ids cannot run on this model ("" if they can): empty, too long, or outside the vocabulary."""
        if not token_ids:
            return "the prompt is empty"
        if len(token_ids) > self.max_positions:
            return f"prompt of {len(token_ids)} tokens exceeds the model's {self.max_positions}"
        if not all(0 <= t < self.vocab_size for t in token_ids):
            return f"prompt token ids must be in 0..{self.vocab_size - 1}"
        return ""

    def kv_layout(self, page_tokens: int, kv_dtype: str = "") -> KvLayout:
        """The KV store's geometry; KV is kept (and moved) in `kv_dtype` ("" = the compute dtype)."""
        dtype = getattr(torch, kv_dtype) if kv_dtype else self.dtype
        return layout_for(self.num_layers, self.num_kv_heads, self.head_dim, page_tokens, dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                past: LayerKv | None = None) -> tuple[torch.Tensor, DynamicCache]:
        """Run the prompt. Returns the last position's logits (vocab,) and the filled cache. `past`: per layer, the
        (keys, values), each (num_kv_heads, P, head_dim), of the prompt's first P tokens, computed before (a prefix
        cache hit; P < N): only tokens P… run, at positions P…, attending to them. The cache and `on_layer` hold
        all N tokens either way."""
        cache = DynamicCache(config=self.config)
        num_past = past[0][0].shape[1] if past else 0
        if num_past >= len(token_ids):
            raise ValueError(f"a past of {num_past} tokens leaves nothing of a {len(token_ids)}-token prompt to run")
        for i, (keys, values) in enumerate(past or ()):
            cache.update(keys[None].to(self.device, self.dtype), values[None].to(self.device, self.dtype), i)
        hooks = []
        if on_layer is not None:
            for i, layer in enumerate(self.model.get_decoder().layers):
                hooks.append(layer.register_forward_hook(self._layer_hook(i, cache, on_layer)))
        try:
            ids = torch.tensor([list(token_ids)[num_past:]], device=self.device)
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        return out.logits[0, -1], cache

    @torch.inference_mode()
    def extend(self, cache: DynamicCache, token_ids: Sequence[int]) -> None:
        """Append `token_ids` to `cache` in one forward, each attending over the cache and the ones before it (a
        replay of tokens already decoded: the KV that stepping them one by one would leave, up to rounding)."""
        ids = torch.tensor([list(token_ids)], device=self.device)
        self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def prefill_scored(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                       top: int = 0) -> tuple[torch.Tensor, DynamicCache, list[TokenLogprobs]]:
        """`prefill`, and each prompt token's log-probability after the tokens before it (tokens 1…N-1) with the
        `top` most likely at each position (OpenAI `echo` with `logprobs`). The vocabulary projection runs on
        PROMPT_LOGITS_CHUNK positions at a time, so a long prompt never holds all N × vocab logits at once."""
        kept: list[torch.Tensor] = []
        hook = self.model.get_decoder().norm.register_forward_hook(lambda _m, _a, out: kept.append(out))
        try:
            logits, cache = self.prefill(token_ids, on_layer)
        finally:
            hook.remove()
        hidden, head, ids = kept[-1][0], self.model.get_output_embeddings(), list(token_ids)  # hidden (N, D)
        scored = []
        for start in range(0, len(ids) - 1, PROMPT_LOGITS_CHUNK):
            stop = min(len(ids) - 1, start + PROMPT_LOGITS_CHUNK)
            scored += prompt_logprobs(head(hidden[start:stop]), ids[start:], top)
        return logits, cache, scored

    @staticmethod
    def _layer_hook(index: int, cache: DynamicCache, on_layer: LayerCallback):
        def hook(_module, _args, _output):
            layer = cache.layers[index]
            on_layer(index, layer.keys[0], layer.values[0])  # (1, H, N, D) → (H, N, D)

        return hook

    @torch.inference_mode()
    def step(self, caches: Sequence[SlabCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of a batch: append tokens[b] to caches[b], each at its own position. Returns the
        next-token logits (B, vocab). Attention must be installed (selective.install): it reads each row's
        own cache."""
        ids = torch.tensor([[t] for t in tokens], device=self.device)
        positions = torch.tensor([[cache.get_seq_length()] for cache in caches], device=self.device)
        # NOTE: a ready 4D mask makes transformers skip building one; each row attends to its whole cache anyway
        unused_mask = torch.ones(len(caches), 1, 1, 1, dtype=torch.bool, device=self.device)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=unused_mask,
                         cache=BatchCache(self.config, list(caches)), use_cache=True)
        return out.logits[:, -1]


def _one_row_at_a_time(linear: torch.nn.Linear, runner: ModelRunner) -> None:
    """Batch invariance: in a decode step (x of shape (B, 1, in), one position per row) every row is projected as
    if it were alone. CPU BLAS multiplies 1, 2–3 and ≥ 4 rows with different kernels, which sum in different
    orders; a row's rounding then depended on how many requests shared its step, and that flipped a Quest
    selection and a greedy token (docs/results/chaos). A batched matmul of B one-row products gives each row the
    one-row result, bit for bit, whatever B. Cost: none alone; the weights are read once per row, so a batch
    steps slower than with one shared matmul (SmolLM2, 512 tokens, one thread: +16% at B = 4, +26% at B = 8;
    docs/operations.md, "Batch invariance"). Prefill (one row of N positions) keeps the plain matmul. The vocabulary
    projection stays shared: its rounding reaches no later state, only the last bits of the logits."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not runner.batch_invariant or x.dim() != 3 or x.shape[1] != 1:
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        rows = x.shape[0]
        out = torch.bmm(x, linear.weight.t().unsqueeze(0).expand(rows, -1, -1))  # (B, 1, in) @ (B, in, out)
        return out if linear.bias is None else out + linear.bias

    linear.forward = forward


def _pad_small_batches(head: torch.nn.Module) -> None:
    """Run the vocabulary projection on 4 rows when a batched step has 2 or 3. Measured with torch 2.13's CPU
    BLAS, one thread, SmolLM2's 49,152 × 576 head: 1 row 11.6 ms, 2 rows 25.9, 3 rows 37.4, 4 rows 17.8 (the
    small-batch kernel is slower than the 4-row one). Rows are independent, so the padding changes nothing else."""
    def pad(module, args):
        x = args[0]
        module._smartgen_rows = x.shape[0]
        if x.shape[0] in (2, 3):
            return (torch.cat([x, x.new_zeros(4 - x.shape[0], *x.shape[1:])]),)
        return None

    def unpad(module, _args, out):
        return out[: module._smartgen_rows]

    head.register_forward_pre_hook(pad)
    head.register_forward_hook(unpad)
