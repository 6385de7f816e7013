from dataclasses import dataclass

from shared.config import ServiceConfig


@dataclass(slots=True)
class KvProfileConfig(ServiceConfig):
    bucket: str = "smartgen_profiles"  # JetStream key-value bucket holding the profiles
