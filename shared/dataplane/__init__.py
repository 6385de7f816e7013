"""The data plane: KV bytes between a prefill and a decode process, never over NATS.

See README.md in this folder for the design. `make_dataplane(kind)` picks an implementation.
"""
from shared.dataplane.base import (ChecksumMismatch, DataPlane, DataPlaneError, Gather, Grant, Lane, Segment,
                                   TicketRefused)


def make_dataplane(kind: str, host: str = "127.0.0.1", port: int = 0, advertise_host: str = "",
                   link_gbps: float = 0.0, checksums: bool = True, cluster_secret: str = "",
                   tls: tuple[str, str, str] | None = None) -> DataPlane:
    """TCP or the in-process fake. (RDMA needs a rendezvous; `shared.runtime.worker` builds it.) A TCP plane only links
    with peers that hold the same `cluster_secret` (shared/dataplane/handshake.py; "" = an open plane), and with
    `tls` (CA, certificate, key: PEM files) only through mutual TLS with peers the CA signed (channel.py)."""
    if kind == "tcp":
        from shared.dataplane.channel import DataPlaneTls
        from shared.dataplane.tcp import TcpDataPlane

        return TcpDataPlane(host, port, advertise_host, link_gbps, checksums, cluster_secret,
                            DataPlaneTls.from_files(*tls) if tls else None)
    if kind == "inproc":
        from shared.dataplane.inproc import InProcDataPlane

        return InProcDataPlane()
    raise ValueError(f"unknown transport {kind!r}: use tcp or inproc")


__all__ = ["ChecksumMismatch", "DataPlane", "DataPlaneError", "Gather", "Grant", "Lane", "Segment", "TicketRefused",
           "make_dataplane"]
