"""Ask a running `smartgen up` what a user would, with the `openai` SDK: the README's first 9,000 characters and a
question, once colocated, then three times smartgen (quest at 10%); prints each request's TTST on the client's
clock (the stream's first two chunks) and the plan smartgen reports.

    python docs/results/fresh-clone/ask.py http://127.0.0.1:18090
"""
import sys
import time
from pathlib import Path

from openai import OpenAI

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18090"
client = OpenAI(base_url=url + "/v1", api_key="unused")
readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()[:9000]
prompt = readme + "\n\nQuestion: what does SmartGen move between the prefill and decode machines?\nAnswer:"
model = client.models.list().data[0].id
for mode in ("colocated", "smartgen", "smartgen", "smartgen"):
    started, times, last = time.perf_counter(), [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"transfer_mode": mode, "selector": "quest", "kv_budget": 0.1})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter() - started)
        last = chunk
    info = getattr(last, "smartgen", None) or (last.model_extra or {}).get("smartgen", {})
    plan = info.get("plan") or {}
    print(f"{mode:9s} prompt {info.get('prompt_tokens')} tokens, TTFT {times[0]:.3f} s, TTST {times[1] - times[0]:.3f} s, "
          f"plan at {plan.get('prefill_tokens_per_s')} tokens/s, {plan.get('num_push_blocks')} push blocks, "
          f"step 1 local {(info.get('step_local_share') or [None])[0]}")
