"""Every line a service writes is one JSON object: structlog's events, other libraries' stdlib records, Python
warnings, stray prints and an uncaught exception alike (shared/runtime/logging.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tools.stack import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import logging, sys, threading, warnings
    import transformers.utils.logging  # imported first, as the services do: its own handler exists already
    from shared.runtime.logging import setup_logging

    log = setup_logging("test", "test-1", "info")
    log.info("own_event", n=1)
    log.debug("hidden_event")
    logging.getLogger("aiohttp.server").warning("aiohttp says %s", "hello")
    logging.getLogger("nats.aio.client").info("below warning: dropped")
    transformers.utils.logging.get_logger("transformers.modeling_utils").warning("transformers says hi")
    warnings.warn("a python warning")
    print("a stray print")
    print("progress 10%\\rprogress 100%", file=sys.stderr)
    thread = threading.Thread(target=lambda: 1 / 0)
    thread.start(); thread.join()
    raise RuntimeError("the end")
""")


def test_every_line_is_json_whoever_writes_it():
    """Run the script above in a fresh interpreter: each of its outputs is a JSON line with the service bound."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).splitlines()
    events = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert all(e["service"] == "test" and e["worker_id"] == "test-1" and "timestamp" in e for e in events), events
    by_text = {e.get("text", e["event"]): e for e in events}
    assert by_text["own_event"]["n"] == 1 and "hidden_event" not in by_text
    assert by_text["aiohttp says hello"]["level"] == "warning" and by_text["aiohttp says hello"]["logger"] == "aiohttp.server"
    assert not any("dropped" in e["event"] for e in events)
    assert by_text["transformers says hi"]["logger"] == "transformers.modeling_utils"
    assert any("a python warning" in e["event"] and e["logger"] == "py.warnings" for e in events)
    assert by_text["a stray print"] == by_text["a stray print"] | {"event": "stray_output", "stream": "stdout"}
    assert by_text["progress 100%"]["stream"] == "stderr"
    uncaught = [e for e in events if e["event"] == "uncaught_exception"]
    assert len(uncaught) == 2 and "ZeroDivisionError" in uncaught[0]["exception"] and "the end" in uncaught[1]["exception"]
