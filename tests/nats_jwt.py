"""An operator-mode NATS setup for tests of `.creds` authentication, made without `nsc`: an operator, a system
account, an application account with JetStream, and one user, as NKeys and signed JWTs (NATS JWT v2:
ed25519-nkey signatures over base64url header.claims). Real deployments make these with `nsc`."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import nkeys

UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
             "leaf": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}  # account limits that enable it


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> tuple[nkeys.KeyPair, bytes]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return nkeys.from_seed(seed), seed


def _jwt(issuer: nkeys.KeyPair, subject: str, name: str, claims: dict) -> str:
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = {"jti": "", "iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name, "sub": subject,
            "nats": {**claims, "version": 2}}
    body["jti"] = base64.b32encode(hashlib.sha512(json.dumps(body).encode()).digest()[:32]).decode().rstrip("=")
    payload = _b64(json.dumps(body).encode())
    return f"{header}.{payload}.{_b64(issuer.sign(f'{header}.{payload}'.encode()))}"


def write_operator_mode(folder: Path) -> tuple[Path, Path]:
    """Write `server.conf` (operator mode, accounts preloaded in memory) and `user.creds` into `folder`; returns
    both paths."""
    operator, _ = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    system, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user, user_seed = _keypair(nkeys.PREFIX_BYTE_USER)
    pub = lambda kp: kp.public_key.decode()  # noqa: E731
    (folder / "operator.jwt").write_text(_jwt(operator, pub(operator), "operator",
                                              {"type": "operator", "system_account": pub(system)}))
    accounts = {pub(system): _jwt(operator, pub(system), "SYS", {"type": "account", "limits": UNLIMITED}),
                pub(account): _jwt(operator, pub(account), "smartgen",
                                   {"type": "account", "limits": {**UNLIMITED, **JETSTREAM}})}
    user_jwt = _jwt(account, pub(user), "service", {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1,
                                                     "payload": -1})
    conf = folder / "server.conf"
    conf.write_text(f"operator: {folder / 'operator.jwt'}\nsystem_account: {pub(system)}\nresolver: MEMORY\n"
                    "resolver_preload: {\n" + "".join(f"  {k}: {v}\n" for k, v in accounts.items()) + "}\n")
    creds = folder / "user.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n")
    creds.chmod(0o600)
    return conf, creds
