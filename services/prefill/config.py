from dataclasses import dataclass

from shared.config import ModelWorkerConfig


@dataclass(slots=True)
class PrefillConfig(ModelWorkerConfig):
    push_timeout_s: float = 60.0  # a layer push not acked by then fails the request
    lease_s: float = 30.0  # partial, smartgen: KV left here is freed this long after the decode node's last `keep`
