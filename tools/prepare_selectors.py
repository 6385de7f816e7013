"""`smartgen prepare-selectors`: the offline preparation some selectors need, written next to the model.

    infinigen  per layer and KV head: an orthogonal skewing matrix from the SVD of calibration queries,
               and the `ratio`·head_dim channels where the skewed queries' magnitude sits
    hata       per layer and KV head: hash weights (num_bits × head_dim) trained so that the Hamming
               similarity of codes ranks keys as the true attention does (cross-entropy against it)

Calibration prompts are Python standard-library sources (always on disk, never used for evaluation);
the paper calibrates on a held-out LongBench subset, which is not available offline.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import DENSE_LAYERS
from tools.args import add_model

if TYPE_CHECKING:  # NOTE: torch and the model load at run time only, so `smartgen --help` starts fast
    import torch

    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import Geometry

KEEP_POSITIONS = 512  # per prompt and layer, the last positions kept as calibration samples


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `prepare-selectors` to the `smartgen` sub-commands."""
    prep = subparsers.add_parser("prepare-selectors", help="offline preparation for infinigen and hata, next to the model")
    prep.add_argument("--selector", choices=["all", "infinigen", "hata"], default="all")
    add_model(prep, "model folder (default SmolLM2)")
    prep.add_argument("--num-prompts", type=int, default=4)
    prep.add_argument("--prompt-tokens", type=int, default=1024)
    prep.add_argument("--out", help="write here instead of <model>/smartgen-selectors")
    prep.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen prepare-selectors`: prepare and write the selectors' files."""
    run(args.model, args.selector, args.num_prompts, args.prompt_tokens, args.out)


def calibration_texts(num_prompts: int) -> list[str]:
    """Long stdlib modules, largest first (deterministic)."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted((p for p in root.glob("*.py") if p.stat().st_size > 20_000), key=lambda p: (-p.stat().st_size, p.name))
    return [p.read_text(errors="replace") for p in files[:num_prompts]]


def collect(runner: ModelRunner, texts: list[str], prompt_tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE queries (H, n, d) and keys (H_kv, n, d) per layer, over the calibration prompts."""
    import torch
    from transformers import AutoTokenizer

    from shared.compute import selective

    tokenizer = AutoTokenizer.from_pretrained(runner.path)
    selective.install(runner.model)
    with selective.capture() as captured:
        for text in texts:
            ids = tokenizer(text)["input_ids"][:prompt_tokens]
            runner.prefill(ids)
            for layer, pairs in captured.items():
                q, k = pairs[-1]
                pairs[-1] = (q[:, -KEEP_POSITIONS:].float(), k[:, -KEEP_POSITIONS:].float())
    return {layer: (torch.cat([q for q, _ in pairs], 1), torch.cat([k for _, k in pairs], 1))
            for layer, pairs in captured.items()}


def prepare_infinigen(qk: dict, geometry: Geometry, ratio: float | None = None) -> dict[str, torch.Tensor]:
    """InfiniGen's tensors from the calibration queries: per layer, `skew.<layer>` (H_kv, d, d) and
    `channels.<layer>` (H_kv, c) with c = ratio·d (ratio None = the selector's RATIO)."""
    import torch

    from shared.compute.selectors.infinigen import RATIO

    ratio = RATIO if ratio is None else ratio
    out = {}
    c = max(1, round(ratio * geometry.head_dim))
    for layer, (q, _) in qk.items():
        skews, channels = [], []
        for h in range(geometry.num_kv_heads):
            group = q[h * geometry.group:(h + 1) * geometry.group].reshape(-1, geometry.head_dim)  # (G·n, d)
            _, _, vh = torch.linalg.svd(group, full_matrices=False)
            skew = vh.T.contiguous()  # (d, d) orthogonal: q·k = (q A)·(k A)
            magnitude = (group @ skew).abs().mean(0)
            skews.append(skew)
            channels.append(torch.sort(torch.topk(magnitude, c).indices).values)
        out[f"skew.{layer}"] = torch.stack(skews)
        out[f"channels.{layer}"] = torch.stack(channels)
    return out


def train_hata(qk: dict, geometry: Geometry, num_bits: int | None = None, steps: int = 150,
               num_queries: int = 128) -> dict[str, torch.Tensor]:
    """HATA's hash weights `weights.<layer>` (H_kv, num_bits, d) per layer (num_bits None = the selector's
    NUM_BITS); the dense layers keep their random initialisation."""
    import torch

    from shared.compute.selectors.hata import NUM_BITS

    num_bits = NUM_BITS if num_bits is None else num_bits
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer, (q, k) in qk.items():
        weights = []
        for h in range(geometry.num_kv_heads):
            keys = k[h]  # (n, d)
            queries = q[h * geometry.group:(h + 1) * geometry.group].reshape(-1, geometry.head_dim)
            queries = queries[torch.randperm(len(queries), generator=gen)[:num_queries]]
            target = torch.softmax(queries @ keys.T / geometry.head_dim ** 0.5, dim=-1)  # true attention
            w = torch.randn(num_bits, geometry.head_dim, generator=gen) / geometry.head_dim ** 0.5
            w.requires_grad_(True)
            opt = torch.optim.Adam([w], lr=0.02)
            for _ in range(steps if layer >= DENSE_LAYERS else 0):
                sim = torch.tanh(queries @ w.T) @ torch.tanh(keys @ w.T).T / num_bits  # (nq, n) in [-1, 1]
                loss = -(target * torch.log_softmax(16 * sim, dim=-1)).sum(-1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            weights.append(w.detach())
        out[f"weights.{layer}"] = torch.stack(weights)
    return out


def run(model: str = "", selector: str = "all", num_prompts: int = 4, prompt_tokens: int = 1024,
        out_dir: Path | None = None) -> list[Path]:
    from safetensors.torch import save_file

    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import Geometry, default_prep_dir, prep_path
    from shared.models import resolve_model

    path = resolve_model(model)
    out_dir = Path(out_dir) if out_dir else default_prep_dir(path)
    started = time.monotonic()
    runner = ModelRunner(path)
    geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads, runner.head_dim)
    qk = collect(runner, calibration_texts(num_prompts), prompt_tokens)
    print(f"calibration: {num_prompts} prompts × {prompt_tokens} tokens in {time.monotonic() - started:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (("infinigen", "hata") if selector == "all" else (selector,)):
        tensors = prepare_infinigen(qk, geometry) if name == "infinigen" else train_hata(qk, geometry)
        save_file({k: v.contiguous() for k, v in tensors.items()}, prep_path(out_dir, name))
        written.append(prep_path(out_dir, name))
        print(f"{name}: wrote {prep_path(out_dir, name)} ({time.monotonic() - started:.0f} s)", flush=True)
    return written
