from dataclasses import dataclass

from schemas import DEFAULT_FLOOR, BudgetFloor
from shared.runtime.config import ConfigError, ModelWorkerConfig


@dataclass(slots=True)
class DecodeConfig(ModelWorkerConfig):
    kv_timeout_s: float = 120.0  # how long `generate` waits for the KV to land before failing the request
    open_timeout_s: float = 60.0  # pages reserved by `open` are freed if `generate` does not follow by then
    # a running request whose gateway's heartbeats stop for this long is aborted (nobody reads its stream; as the
    # gateway's worker_ttl_s): services/decode/gateway_watch.py
    gateway_ttl_s: float = 5.0
    max_batch: int = 32  # continuous batching: at most this many running requests step in one forward
    # a request's tokens do not depend on what else steps with it (each row projected as if alone; costs
    # throughput at B ≥ 2, docs/operations.md "Batch invariance"); false: faster batches whose rounding depends on the batch
    batch_invariant: bool = True
    # path 3 reads the rest of a request's KV only while it can all arrive before the completion's last token (its
    # bytes at the plan's link rate against the steps left at the measured step time); false: whenever planned.
    # Measured: docs/results/serve-2k-background-finish (TBT at 2K, R = 2: 1.04× no background, against 1.34×)
    background_if_it_can_finish: bool = True
    # on-demand reads of scattered tokens (token-level selectors) as one gather per layer and chunk, not one segment
    # per run (services/decode/remote.py); false: always segments, as before gathers existed
    gather_reads: bool = True
    # path 2's gathers issued and received by the torch thread on a reads-only link of its own to each prefill worker
    # (services/decode/direct_reads.py), not through the event loop; plain TCP only. false: every read via the loop
    direct_reads: bool = True
    # path 2's read-ahead for every selector, not only InfiniGen (whose selection is the speculated query's): a layer's
    # selection guessed with the speculated query while the layer before runs, its remote part read a layer early,
    # where most layers read (services/decode/reads.py SPECULATE_WHEN_READING); a wrong guess costs bytes and a selection
    speculate_guesses: bool = False
    # the budget floor (schemas/constants.py BudgetFloor): dense below selective_min_tokens cached tokens; above,
    # at least min_budget_tokens, with the first sink_tokens and the last recent_tokens always selected
    selective_min_tokens: int = DEFAULT_FLOOR.dense_below
    min_budget_tokens: int = DEFAULT_FLOOR.min_tokens
    sink_tokens: int = DEFAULT_FLOOR.sinks
    recent_tokens: int = DEFAULT_FLOOR.recent
    # the selection's memory (BudgetFloor.stick): entries a request's earlier steps selected score this many standard
    # deviations of the step's scores higher (HATA, InfiniGen); 0 = none
    selection_stick: float = DEFAULT_FLOOR.stick
    # host memory for the decode side's prefix cache (shared/compute/prefix_cache.py): KV pages of finished full-mode
    # requests' prompts, copied into a new request's slab where its prompt starts the same way, so the
    # prefill pushes only the rest (a conversation's next turn moves its latest answer and question); 0 = off
    decode_prefix_cache_mb: int = 1024  # fp32 SmolLM2 (46 KB a token): 22K tokens

    def validate(self) -> None:
        ModelWorkerConfig.validate(self)
        if self.gateway_ttl_s <= 0:
            raise ConfigError("gateway_ttl_s must be positive (seconds without a gateway's heartbeat)")
        if self.max_batch < 1:
            raise ConfigError("max_batch must be ≥ 1")
        if min(self.selective_min_tokens, self.sink_tokens, self.recent_tokens) < 0 or self.min_budget_tokens < 1:
            raise ConfigError("selective_min_tokens, sink_tokens and recent_tokens must be ≥ 0, min_budget_tokens ≥ 1")
        if not 0 <= self.selection_stick <= 10:
            raise ConfigError(f"selection_stick {self.selection_stick} must be within [0, 10] (standard deviations; 0 = none)")
        if self.decode_prefix_cache_mb < 0:
            raise ConfigError(f"decode_prefix_cache_mb {self.decode_prefix_cache_mb} must be ≥ 0 (0 turns the decode "
                              "side's prefix cache off)")

    @property
    def floor(self) -> BudgetFloor:
        return BudgetFloor(self.min_budget_tokens, self.selective_min_tokens, self.sink_tokens, self.recent_tokens,
                           self.selection_stick)
