from dataclasses import dataclass

from shared.runtime.config import ConfigError, ModelWorkerConfig


@dataclass(slots=True)
class PrefillConfig(ModelWorkerConfig):
    push_timeout_s: float = 60.0  # a layer push not acked by then fails the request
    lease_s: float = 30.0  # partial, smartgen: KV left here is freed this long after the decode node's last `keep`
    # the exact push holds layers back only from this share of the layers on (`Transfer.holds_back` in
    # services/prefill/pushes.py); 0: wherever the link's backlog says (the guard of 2/3 it once needed is measured
    # unneeded)
    exact_from_share: float = 0.0
    # at start, a prefill of this many tokens measures the prompt rate the broker's first plan uses (0 = none)
    warmup_tokens: int = 512
    # host memory for the prefix cache (shared/compute/prefix_cache.py): KV pages of earlier prompts, reused by
    # prompts that start the same way; 0 = off (every prompt computed whole)
    prefix_cache_mb: int = 1024  # fp32 SmolLM2 (46 KB a token): 22K tokens

    def validate(self) -> None:
        ModelWorkerConfig.validate(self)
        if not 0 <= self.exact_from_share <= 1:
            raise ConfigError(f"exact_from_share {self.exact_from_share} must be in [0, 1]")
        if self.warmup_tokens < 0:
            raise ConfigError(f"warmup_tokens {self.warmup_tokens} must be ≥ 0")
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb {self.prefix_cache_mb} must be ≥ 0 (0 turns the prefix cache off)")
