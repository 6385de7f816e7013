"""`bench serve --prefix-hit`'s prompts (tools/workloads.py `shared_document`): one document, then a question each.
The document is text whatever it holds: an 8K prompt's document (a standard-library file's first 6,000 tokens) has
braces, which used to be read as format fields (KeyError: 'open, stat')."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from tools import workloads

BRACES = 'CONFIG = {"open, stat": 1}\nname = f"{prefix}-{n:>4}"\ntable = "{}{{}}"\n'


def test_every_prompt_opens_with_the_same_document_braces_and_all(real_model_path, tmp_path, monkeypatch):
    files = []
    for i in range(3):
        path = tmp_path / f"module_{i}.py"
        path.write_text(f"# module {i}\n" + BRACES * 400)
        files.append(path)
    monkeypatch.setattr(workloads, "stdlib_files", lambda min_chars=0: list(files))
    tokenizer = AutoTokenizer.from_pretrained(real_model_path)
    samples = workloads.shared_document(tokenizer, 3, 2000, 0.75)
    prompts = [sample.prompt for sample in samples]
    document = prompts[0].split("\n# Question 1:")[0]
    assert '{"open, stat": 1}' in document and 'f"{prefix}-{n:>4}"' in document and '"{}{{}}"' in document
    assert all(prompt.startswith(document + f"\n# Question {k + 1}:") for k, prompt in enumerate(prompts))
    assert len(set(prompts)) == 3
    shares = [len(tokenizer(document)["input_ids"]) / len(tokenizer(p)["input_ids"]) for p in prompts]
    assert all(0.7 <= share <= 0.8 for share in shares), shares  # the document is ~75% of each prompt
