"""Throw-away certificates for TLS tests, made with the openssl command (tests skip where it is missing)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# extended key usages per certificate: a data-plane peer both dials and accepts, so its certificate does both
USES = {"server": "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", "client": "extendedKeyUsage=clientAuth\n",
        "peer": "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"}


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA of its own (each folder: another CA), and a server (for 127.0.0.1), a client and a peer certificate,
    all signed by it. Returns the PEM files by name: ca.pem, server.pem/.key, client.pem/.key, peer.pem/.key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=smartgen-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, ext in USES.items():
        (folder / f"{name}.ext").write_text(ext)
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=smartgen-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {n: folder / n for n in ("ca.pem", *(f"{name}.{kind}" for name in USES for kind in ("pem", "key")))}
