"""tools/gpu_check.sh, the script a lent GPU runs (issue #33, item 5), at tiny size on this machine's CPU: every
part runs, the files the device tool brings back (at most eight) are there, and each holds what its reader needs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.stack import REPO_ROOT


def test_the_gpu_check_runs_end_to_end_at_tiny_size_on_cpu(tiny_model_path: Path, tmp_path: Path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "GPU_CHECK_DEVICE": "cpu",
           "GPU_CHECK_MODEL": str(tiny_model_path), "GPU_CHECK_CONTEXTS": "160", "GPU_CHECK_SELECTORS": "quest",
           "GPU_CHECK_SERVE_TOKENS": "96", "GPU_CHECK_SERVE_SELECTOR": "quest",
           "GPU_CHECK_SERVE_REQUESTS": "1", "SMARTGEN_TORCH_THREADS": "1"}
    done = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["decode-batch-160.json", "decode-step-160.json", "device.txt", "log.txt",
                     "serve-report.md", "serve-runs.json"]
    assert (out / "device.txt").read_text().startswith("device cpu")
    step = json.loads((out / "decode-step-160.json").read_text())
    assert step["device"] == "cpu" and step["context"] == 160 and step["budget"] == 0.1
    (timing,) = step["threads"].values()
    assert set(timing["step_ms"]) == {"dense", "quest"} and all(ms > 0 for ms in timing["step_ms"].values())
    batch = json.loads((out / "decode-batch-160.json").read_text())
    assert {(r["selector"], r["batch"]) for r in batch["rows"]} == {("dense", 1), ("dense", 8), ("quest", 1), ("quest", 8)}
    runs = json.loads((out / "serve-runs.json").read_text())
    served = {r["mode"] for r in runs["runs"]}
    assert served >= {"colocated-selective", "quantized-4bit", "smartgen"}, served
