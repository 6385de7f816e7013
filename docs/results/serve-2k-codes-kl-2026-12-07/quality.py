"""The KL column of this folder's run again, in one process, on the same prompts (`bench serve`'s own samples: its
default tasks, 3 prompts of 2K), for dense, quantized-4bit, HATA over exact KV and HATA over smartgen's K8V8 and K8V4
records (its selections from the exact keys, as the prefill makes its metadata), under the decode worker's default
budget floor.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/serve-2k-codes-kl-2026-12-07/quality.py
"""
from dataclasses import asdict

from transformers import AutoTokenizer

from schemas import DEFAULT_FLOOR
from shared.runtime.models import prepare_default_model
from tools.bench.serve import BenchConfig, build_samples, measure_quality

path = str(prepare_default_model())
cfg = BenchConfig(modes=["quantized-4bit", "smartgen", "smartgen-4bit"], prompt_tokens=[2048], requests=3)
tokenizer = AutoTokenizer.from_pretrained(path)
prompts = {2048: [s.prompt for s in build_samples(tokenizer, cfg.tasks, cfg.requests, 2048)]}
for mode, q in measure_quality(cfg, path, tokenizer, prompts, asdict(DEFAULT_FLOOR)).items():
    print(f"{mode:20s} {q['quality_config']:16s} KL {q['kl_mean']:.4f}  agreement {q['agreement_mean']:.3f}")
