from dataclasses import dataclass

from shared.config import ModelWorkerConfig


@dataclass(slots=True)
class DecodeConfig(ModelWorkerConfig):
    kv_timeout_s: float = 120.0  # how long `generate` waits for the KV to land before failing the request
    open_timeout_s: float = 60.0  # pages reserved by `open` are freed if `generate` does not follow by then
