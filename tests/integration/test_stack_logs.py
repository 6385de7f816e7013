"""`smartgen up`'s whole output is JSON lines, its own and every service's, with an access log line per HTTP
request of the API."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from tests.integration.conftest import post_json
from tests.integration.test_cli_up import interrupt_and_check_clean_exit, start_up, wait_for_workers
from tools.nats_server import free_port


def test_every_line_of_the_stack_is_json_with_an_access_log(tiny_model_path, tmp_path):
    """Start `smartgen up` on the tiny model, send a completion (with a client request id), a bad request and a
    404, stop it: every line of its stdout and stderr parses as a JSON object, each of the five services logged,
    and each of the three requests has its access-log line (method, path, status, duration, request id)."""
    port = free_port()
    log = tmp_path / "up.log"
    proc = start_up(["--model", str(tiny_model_path), "--port", str(port)],
                    {"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_NATS_URL": ""}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_workers(url, {"prefill": 1, "decode": 1, "broker": 1, "kvprofile": 1}, proc, log)
        status, body = post_json(url + "/v1/completions", {"prompt": "Hi there", "max_tokens": 3},
                                 headers={"X-Request-Id": "logged-request-1"})
        assert status == 200, body
        status, _ = post_json(url + "/v1/completions", {"prompt": "Hi there", "max_tokens": -1})
        assert status == 400
        try:
            urllib.request.urlopen(url + "/no-such-route")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        interrupt_and_check_clean_exit(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    events = []
    for number, line in enumerate(lines, 1):
        try:
            events.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"line {number} of {len(lines)} is not JSON: {line!r}") from None
    assert all(isinstance(e, dict) and "event" in e and "level" in e for e in events)
    assert {e.get("service") for e in events} >= {"smartgen", "gateway", "broker", "kvprofile", "prefill", "decode"}
    access = [e for e in events if e["event"] == "http_request" and e["service"] == "gateway"]
    done = next(e for e in access if e.get("request_id") == "logged-request-1")
    assert done["method"] == "POST" and done["path"] == "/v1/completions" and done["status"] == 200
    assert done["duration_ms"] > 0
    assert any(e["path"] == "/v1/completions" and e["status"] == 400 for e in access)
    assert any(e["path"] == "/no-such-route" and e["status"] == 404 for e in access)
