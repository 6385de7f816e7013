"""Two lm-evaluation-harness tasks over data in this file (no hub access): one scored by log-likelihood
(`smartgen_capitals_mc`: pick the capital among four) and one by generation (`smartgen_capitals_gen`: say the
capital, exact match up to the end of the line). They exist to check that the gateway serves what lm-eval's
`local-completions` and `local-chat-completions` models ask for (echo + logprobs; generation until a stop
string) with the scores lm-eval's own `hf` backend gets on the same samples.

    python -m tools.eval.lmeval_tasks DIR   # writes DIR/<task>.yaml and DIR/capitals.jsonl
    lm_eval run --include_path DIR --tasks smartgen_capitals_mc,smartgen_capitals_gen --model local-completions \\
        --model_args model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<model dir>
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("China", "Beijing"), ("Kenya", "Nairobi"),
            ("Greece", "Athens"), ("Norway", "Oslo"), ("Peru", "Lima"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
            ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Sweden", "Stockholm"), ("Cuba", "Havana"),
            ("Thailand", "Bangkok")]

MC_TASK = """task: smartgen_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: smartgen_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: What is the capital of Chile?\\nA: Santiago\\nQ: What is the capital of {{{{country}}}}?\\nA:"
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""


def rows() -> list[dict]:
    """Each country with four candidate capitals (its own and the next three's), the right one at a varying place."""
    out = []
    for i, (country, capital) in enumerate(CAPITALS):
        others = [CAPITALS[(i + k) % len(CAPITALS)][1] for k in (1, 2, 3)]
        answer = i % 4
        choices = others[:answer] + [capital] + others[answer:]
        out.append({"country": country, "capital": capital, "choices": choices, "answer": answer})
    return out


def write(folder: Path) -> list[str]:
    """The data and both task files in `folder`; returns the task names."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    (folder / "smartgen_capitals_mc.yaml").write_text(MC_TASK.format(data=data.resolve()))
    (folder / "smartgen_capitals_gen.yaml").write_text(GEN_TASK.format(data=data.resolve()))
    return ["smartgen_capitals_mc", "smartgen_capitals_gen"]


if __name__ == "__main__":
    print(",".join(write(Path(sys.argv[1]))))
