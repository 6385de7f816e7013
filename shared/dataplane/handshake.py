"""Who may open a TCP data-plane link: a mutual challenge–response keyed by the cluster secret.

Every member of a SmartGen cluster holds the same secret (a file: `smartgen up` writes one per run; compose and
Kubernetes mount one). A connection becomes a link only after both ends have shown they hold it, so a stranger
who can reach the port is refused before any KV byte moves in either direction. Tickets stay the per-transfer
check on top of this.

    dialer                                          listener
      ── connect ─────────────────────────────────────▶
      ◀──────────────────── CHALLENGE  nonce_l (32 B) ──
      ── HELLO  nonce_d (32 B) | proof_d (32 B) | address ▶   proof_d = HMAC(secret, "dialer"  | nonce_l | nonce_d | address)
      ◀────────────── WELCOME  proof_l (32 B), or REFUSED ─   proof_l = HMAC(secret, "listener" | nonce_d | nonce_l | address)

Each side proves itself over the other's fresh nonce, so a recorded exchange cannot be replayed, and the
listener's proof covers the address the dialer announced. HMAC-SHA256; digests compared in constant time.
With no secret configured the key is empty: links still open between peers without one (a warning says the
data plane is open), and a peer with a secret and a peer without one refuse each other.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256


class PeerRefused(ConnectionError):
    """The other end of a data-plane connection did not prove it holds the cluster secret."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def dialer_proof(key: bytes, listener_nonce: bytes, dialer_nonce: bytes, address: bytes) -> bytes:
    return hmac.digest(key, b"dialer|" + listener_nonce + dialer_nonce + address, hashlib.sha256)


def listener_proof(key: bytes, dialer_nonce: bytes, listener_nonce: bytes, address: bytes) -> bytes:
    return hmac.digest(key, b"listener|" + dialer_nonce + listener_nonce + address, hashlib.sha256)


def hello_payload(key: bytes, listener_nonce: bytes, dialer_nonce: bytes, address: bytes) -> bytes:
    """What the dialer sends after the challenge: its nonce, its proof, its own data-plane address."""
    return dialer_nonce + dialer_proof(key, listener_nonce, dialer_nonce, address) + address


def check_hello(key: bytes, listener_nonce: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """The listener's check of a hello: (dialer nonce, dialer address), or PeerRefused."""
    head = NONCE_BYTES + PROOF_BYTES
    if len(payload) <= head:
        raise PeerRefused("the hello is too short to hold a nonce, a proof and an address")
    nonce, proof, address = payload[:NONCE_BYTES], payload[NONCE_BYTES:head], payload[head:]
    if not hmac.compare_digest(proof, dialer_proof(key, listener_nonce, nonce, address)):
        raise PeerRefused("the peer does not hold this cluster's secret")
    return nonce, address


def check_welcome(key: bytes, dialer_nonce: bytes, listener_nonce: bytes, address: bytes, proof: bytes) -> None:
    """The dialer's check of the listener's answer; PeerRefused unless it proves the listener holds the secret."""
    if not hmac.compare_digest(proof, listener_proof(key, dialer_nonce, listener_nonce, address)):
        raise PeerRefused("the listener does not hold this cluster's secret")
