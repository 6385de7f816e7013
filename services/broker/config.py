from dataclasses import dataclass

from shared.runtime.config import ConfigError, ServiceConfig


@dataclass(slots=True)
class BrokerConfig(ServiceConfig):
    worker_ttl_s: float = 5.0  # a worker whose heartbeats stop for this long is forgotten
    speculative_ratio: float = 0.1  # path 3: share of the remaining blocks fed to the background lane per decode step
    plan_ttl_s: float = 60.0  # a live plan with no progress for this long expires
    link_gbps: float = 0.0  # the link rate to assume until a prefill worker has measured one; 0 = default_link_gbps
    default_link_gbps: float = 10.0  # the link rate (Gbit/s) assumed when neither link_gbps nor a measurement says
    default_prefill_tokens_per_s: float = 1000.0  # assumed until a prefill worker reports its measured rate
    profile_ttl_s: float = 30.0  # cached profiles are asked for again after this long (updates also drop them)

    def validate(self) -> None:
        ServiceConfig.validate(self)
        if not 0 < self.speculative_ratio <= 1:
            raise ConfigError("speculative_ratio must be in (0, 1]")
        if self.plan_ttl_s <= 0 or self.default_link_gbps <= 0 or self.default_prefill_tokens_per_s <= 0:
            raise ConfigError("plan_ttl_s, default_link_gbps and default_prefill_tokens_per_s must be positive")
        if self.link_gbps < 0:
            raise ConfigError("link_gbps must be ≥ 0")
