"""Choosing the next token from logits: greedy at temperature 0, else seeded sampling.

A sampled token depends only on (seed, token index, logits), not on which process draws it,
so a request gives the same tokens colocated or disaggregated.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from schemas import Sampling, TokenLogprobs
from shared.compute.grammar import TokenGrammar

MAX_REDRAWS = 16  # structured output: draws of tokens the grammar's mask allowed but its parser refuses


@dataclass
class FirstToken:
    """What a prefill gives: the first completion token, and the log-probabilities its request asked for."""

    token: int
    logprobs: TokenLogprobs | None = None  # Sampling.logprobs ≥ 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # Sampling.echo: prompt tokens 1…N-1
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not computed


def first_token(runner, token_ids: Sequence[int], sampling: Sampling, on_layer=None, past=None) -> FirstToken:
    """Prefill `token_ids` on `runner` (a ModelRunner; `on_layer` and `past` as in its `prefill`) and sample
    token 0, scoring what `sampling` asks for. NOTE: echo's prompt scores need every position run: no `past`."""
    if sampling.echo and sampling.logprobs >= 0:
        if past:
            raise ValueError("prompt log-probabilities (echo) need the whole prompt computed: no past KV")
        logits, _, prompt = runner.prefill_scored(token_ids, on_layer, sampling.logprobs)
    else:
        (logits, _), prompt = runner.prefill(token_ids, on_layer, past), []
    grammar = TokenGrammar(runner.path, runner.vocab_size, sampling.end_ids, sampling.grammar) if sampling.grammar else None
    token = sample(logits, sampling, 0, token_ids, grammar=grammar)
    return FirstToken(token, scored(logits, token, sampling), prompt)


def scored(logits: torch.Tensor, token: int, sampling: Sampling) -> TokenLogprobs | None:
    """`token`'s log-probabilities if `sampling` asks for them (logprobs ≥ 0), else None."""
    return token_logprobs(logits, token, sampling.logprobs) if sampling.logprobs >= 0 else None


def sample(logits: torch.Tensor, sampling: Sampling, index: int, prompt: Sequence[int] = (),
           completion: Sequence[int] = (), grammar: TokenGrammar | None = None) -> int:
    """logits: (vocab,) for the last position; index: the completion token's index (0 = first token); `prompt`
    and `completion` (its tokens 0…index-1): what the penalties look at; `grammar` (the request's, when
    `sampling.grammar` is set): only the tokens it allows after completion[:index] can come out."""
    if grammar is not None:
        logits = grammar.masked(logits, completion[:index])
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0:
        logits = penalized(logits, sampling, prompt, completion[:index])
    if sampling.logit_bias:
        logits = biased(logits, sampling.logit_bias)
    if index < sampling.min_tokens and sampling.end_ids:  # too early to end: the end tokens are not candidates
        logits = logits.clone()
        logits[torch.tensor(sampling.end_ids, device=logits.device)] = float("-inf")
    token = drawn(logits, sampling, index)
    for _ in range(MAX_REDRAWS):
        if grammar is None or grammar.accepts(token):
            return token
        # NOTE: llguidance's mask can let through a token its parser then refuses (seen with control characters in a
        # regex): that token is taken out and the draw repeated; with nothing left the answer ends
        logits = logits.clone()
        logits[token] = float("-inf")
        if not torch.isfinite(logits).any():
            break
        token = drawn(logits, sampling, index)
    return grammar.dead_end()


def drawn(logits: torch.Tensor, sampling: Sampling, index: int) -> int:
    """The token drawn from (processed) logits (vocab,): greedy at temperature 0, else seeded by (seed, index)."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / sampling.temperature
    if not torch.isfinite(scaled.max()):  # a temperature so small (1e-300) it overflows: its limit, greedy
        return int(torch.argmax(logits))
    generator = torch.Generator().manual_seed((sampling.seed * 1_000_003 + index) % 2**63)
    kept = truncated(scaled, sampling.top_k, sampling.top_p, sampling.min_p)
    # by the inverse of the cumulative distribution: one uniform number u in (0, 1] and a binary search for the first
    # token whose cumulative probability reaches u × the total, so a token of probability 0 is never drawn. NOTE:
    # torch.multinomial took ~1.5 ms per draw over SmolLM2's 49,152 tokens on CPU (this: ~0.1 ms), per sampled row
    # and step: more than a whole decode step of a small model (docs/results/hostile-2026-12-07)
    cdf = torch.softmax(kept, dim=-1).double().cumsum(0)  # float64: the tail's tiny probabilities keep their width
    u = 1.0 - torch.rand(1, generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1]).clamp_(max=cdf.numel() - 1))


def penalized(logits: torch.Tensor, sampling: Sampling, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    """logits (vocab,) with the penalties applied, greedy or not: repetition_penalty over every token of the
    prompt and the completion (positive logits divided by it, negative ones multiplied: vLLM's and HF's rule),
    then presence_penalty once and frequency_penalty per occurrence over the completion's tokens (OpenAI's)."""
    out = logits.float().clone()
    if sampling.repetition_penalty != 1.0 and (prompt or completion):
        seen = torch.tensor(sorted({*prompt, *completion}), device=out.device)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty)
    if completion and (sampling.presence_penalty or sampling.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(completion), device=out.device), minlength=out.numel()).float()
        out -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    return out


def biased(logits: torch.Tensor, logit_bias: dict[str, float]) -> torch.Tensor:
    """logits (vocab,) with OpenAI's `logit_bias` added: token id (a string) → bias (±100 bans or forces it)."""
    out = logits.float().clone()
    ids = torch.tensor([int(t) for t in logit_bias], device=out.device)
    out[ids] += torch.tensor(list(logit_bias.values()), device=out.device)
    return out


def truncated(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """scaled (vocab,) logits with every token outside the `top_k` most likely (0 = no limit), outside the nucleus
    (the most likely tokens whose probabilities, in order, first reach `top_p`), and less likely than `min_p` × the
    most likely token set to -inf. The most likely token always stays; so do tokens tied with the k-th."""
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True)
        before = probs.cumsum(0) - probs  # the mass of the tokens more likely than each
        outside = before >= top_p
        outside[0] = False  # NOTE: a top_p below float32's smallest value rounds to 0 there; the first stays anyway
        scaled = scaled.clone()
        scaled[order[outside]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return scaled


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability under `logits` (vocab,) (the raw distribution: no temperature) and the `top`
    most likely tokens with theirs."""
    return _logprobs(logits[None], [token], top)[0]


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """logits (n, vocab) at positions 0…n-1 of a prompt: each next prompt token's log-probability (tokens
    1…n, n = len(token_ids) - 1) and the `top` most likely tokens there."""
    return _logprobs(logits, token_ids[1: logits.shape[0] + 1], top)


def _logprobs(logits: torch.Tensor, chosen: list[int], top: int) -> list[TokenLogprobs]:
    """logits (n, vocab); chosen[i]: the token scored at row i. Each one's log-probability and the row's top."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values = logp.gather(1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0].tolist()
    best = logp.topk(top, dim=-1) if top > 0 else None
    ids = best.indices.tolist() if best is not None else [[] for _ in values]
    tops = best.values.tolist() if best is not None else [[] for _ in values]
    return [TokenLogprobs(v, i, t) for v, i, t in zip(values, ids, tops)]
