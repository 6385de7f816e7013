from dataclasses import dataclass

from shared.config import ServiceConfig


@dataclass(slots=True)
class BrokerConfig(ServiceConfig):
    worker_ttl_s: float = 5.0  # a worker whose heartbeats stop for this long is forgotten
