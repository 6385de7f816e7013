"""A stranger's first requests with the openai SDK against `make up` (http://127.0.0.1:8000/v1): a streamed chat in
full, smartgen and quantized, a plain completion, the model list.

    .venv/bin/python docs/results/fresh-clone/ask_modes.py
"""
import time
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
for mode in ("full", "smartgen", "quantized"):
    started = time.time(); text = []; last = None
    for chunk in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", stream=True, max_tokens=48, temperature=0,
            messages=[{"role": "user", "content": "Write a haiku about slow networks."}],
            extra_body={"transfer_mode": mode}):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        last = chunk
    sg = getattr(last, "smartgen", None) or (last.model_extra or {}).get("smartgen")
    print(mode, round(time.time() - started, 2), "s:", repr("".join(text)[:80]), "| ttst", sg.get("ttst_s") if sg else None, "kv", sg.get("kv_bytes") if sg else None)
r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0, extra_body={"transfer_mode": "smartgen"})
print("completion:", repr(r.choices[0].text), r.usage)
print("models:", [m.id for m in client.models.list().data])
