from dataclasses import dataclass

from shared.config import ModelWorkerConfig


@dataclass(slots=True)
class PrefillConfig(ModelWorkerConfig):
    push_timeout_s: float = 60.0  # a layer push not acked by then fails the request
