from dataclasses import dataclass, field

from schemas import SELECTORS, SERVABLE_TRANSFER_MODES, ModeName
from shared.runtime.config import ConfigError, ServiceConfig


@dataclass(slots=True)
class GatewayConfig(ServiceConfig):
    gateway_port: int = 8000  # the OpenAI API (and this service's admin routes)
    model: str = ""  # where the tokenizer and chat template come from; "" = the cached default SmolLM2
    served_model_name: str = ""  # the id clients send as `model`; "" = the model folder's name
    transfer_mode: str = ModeName.FULL  # default for requests that do not say
    # for partial, smartgen and auto requests that name no selector; "" = by the prompt's length (schemas'
    # SELECTIVE_DEFAULTS: HATA at 20% on short prompts, keycodes at 10% with 4-bit values on long ones)
    default_selector: str = ""
    worker_ttl_s: float = 5.0  # a worker whose heartbeats stop for this long is dropped
    request_timeout_s: float = 300.0  # a prefill reply or a gap between streamed tokens longer than this fails the request
    max_tokens_default: int = 16  # completions without max_tokens (OpenAI's default)
    chat_max_tokens_default: int = 1024  # chat without max_tokens; the decode worker reserves KV for this many
    # the admission queue (admission.py): requests running at once (0 = what the decode workers say they take),
    # how many may wait beyond that (then 429), and for how long (then 503)
    max_running: int = 0
    max_waiting: int = 64
    queue_timeout_s: float = 30.0
    # the most requests one client (its IP address) runs at once; more wait their turn, clients taking turns for
    # freed slots (-1 = half the capacity, at least 1; 0 = no cap)
    max_running_per_client: int = -1
    # the most requests one client may have waiting in the queue (of max_waiting): more get a 429, so one client
    # cannot fill the queue and turn the others away (-1 = half of max_waiting, at least 1; 0 = no cap)
    max_waiting_per_client: int = -1
    # behind a proxy you run: a request's client is the last X-Forwarded-For address (the one the proxy saw), not
    # the proxy's. Off, the header is ignored: a client could name itself anything there
    trust_forwarded_for: bool = False
    # The OpenAI API's key: "" = open; set, every /v1 request needs `Authorization: Bearer <api_key>` (the openai
    # SDK's api_key) or gets OpenAI's 401. api_key_file: a file holding it (docker secrets), as the other secrets.
    api_key: str = field(default="", repr=False)
    api_key_file: str = ""
    # also export vLLM's metric names (vllm:time_to_first_token_seconds, …, labelled model_name) beside SmartGen's,
    # for dashboards and alerts built for vLLM (shared/runtime/vllm_metrics.py)
    vllm_metrics: bool = False
    # KV-aware routing (routing.py): a full-mode request goes to the decode worker holding its longest cached prefix
    # while that worker runs at most this many requests more than the least loaded one (beyond: the least loaded)
    cache_route_slack: int = 4
    max_body_mb: float = 4.0  # the largest request body read (a larger one is a 413): 8K-token prompts are ~50 KB

    def validate(self) -> None:
        ServiceConfig.validate(self)
        if self.transfer_mode not in SERVABLE_TRANSFER_MODES:
            raise ConfigError(f"transfer_mode {self.transfer_mode!r}: use one of {', '.join(SERVABLE_TRANSFER_MODES)}")
        if self.default_selector and self.default_selector not in SELECTORS:
            raise ConfigError(f"default_selector {self.default_selector!r}: use one of {', '.join(SELECTORS)}, or \"\" "
                              "to choose by the prompt's length")
        if self.max_running < 0 or self.max_waiting < 0 or self.queue_timeout_s <= 0:
            raise ConfigError("max_running and max_waiting must be ≥ 0 and queue_timeout_s positive")
        if self.max_running_per_client < -1:
            raise ConfigError(f"max_running_per_client {self.max_running_per_client}: use a number of requests, 0 for "
                              "no cap, or -1 for half the capacity")
        if self.max_waiting_per_client < -1:
            raise ConfigError(f"max_waiting_per_client {self.max_waiting_per_client}: use a number of requests, 0 for "
                              "no cap, or -1 for half of max_waiting")
        if self.cache_route_slack < 0:
            raise ConfigError(f"cache_route_slack {self.cache_route_slack} must be ≥ 0")
        if self.max_body_mb <= 0:
            raise ConfigError("max_body_mb must be positive")
        if not 0 <= self.gateway_port < 65536:
            raise ConfigError(f"gateway_port {self.gateway_port} is not a TCP port")
