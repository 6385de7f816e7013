"""Shared fixtures: the models (real SmolLM2 and a tiny random Llama with its tokenizer), a real
nats-server on a free port, and a whole stack of real service processes with a leak check."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.runtime.models import prepare_default_model
from tools.tiny_model import make_tiny_model

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def forkserver(tmp_path_factory: pytest.TempPathFactory):
    """Every service a Stack starts in this session (here or in a tool the tests run) is a fork of one interpreter
    that imported torch and transformers once (tools/forkserver.py: ~13 s less a stack start on two cores).
    SMARTGEN_FORKSERVER=0 turns it off; test_cli_up.py's `smartgen up` runs without it (the cold path)."""
    if os.environ.get("SMARTGEN_FORKSERVER") == "0":  # NOTE: before any import (the RDMA guest has no tracing libraries)
        del os.environ["SMARTGEN_FORKSERVER"]
        yield None
        return
    import subprocess
    import sys
    import time

    from tools.nats_server import die_with_parent
    from tools.stack import REPO_ROOT

    path = str(tmp_path_factory.mktemp("forkserver") / "socket")
    server = subprocess.Popen([sys.executable, "-u", "-m", "tools.forkserver", path], cwd=REPO_ROOT,
                              stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert server.poll() is None and time.monotonic() < deadline, "the fork server did not start"
        time.sleep(0.1)
    os.environ["SMARTGEN_FORKSERVER"] = path
    yield path
    del os.environ["SMARTGEN_FORKSERVER"]
    server.terminate()
    server.wait(10)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The real SmolLM2 folder (converted once; `make test` does it before pytest starts)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Path:
    """A 4-layer random Llama (hidden 64, 4 heads, 2 KV heads) with the real tokenizer: loads in a second."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=real_model_path)


@pytest.fixture(scope="session")
def tiny8_model_path(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Path:
    """The same with 8 layers (six of them selective), made once: read-only, like every model folder here."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny8"), tokenizer_from=real_model_path, num_layers=8)


@pytest.fixture
def nats_server():
    from tools.nats_server import NatsServer

    with NatsServer() as server:
        yield server
