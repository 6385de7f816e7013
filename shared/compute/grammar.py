"""Structured output on a model worker: a grammar's token mask in the sampler (llguidance).

The gateway turns `response_format` / `tools` into an llguidance grammar (its JSON text) and checks it; the text
travels in `Sampling.grammar`. A worker compiles it against its tokenizer (`GrammarCache`: a few compiled
grammars, copied per request) and keeps one `TokenGrammar` per request. Its state is a function of the completion
tokens it has consumed, so whichever side sampled a token (the prefill's token 0, a decode step, a replay after a
recompute), the matcher catches up on the tokens it has not seen (`follow`) before it masks the next position.

Why llguidance and not xgrammar: docs/structured-output.md (both cost microseconds a token on this CPU;
llguidance is one 3 MB wheel with no dependencies, xgrammar pulls triton, ~290 MB).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import llguidance
import llguidance.torch
import torch

GRAMMAR_CACHE_SIZE = 32  # compiled grammars kept per worker (a grammar compiles in ~1 ms; a schema repeats)
_BITS = torch.arange(32, dtype=torch.int32)  # bit b of a 32-bit mask word: token 32·word + b


class GrammarError(ValueError):
    """The grammar does not compile, or a token it does not allow was fed to it."""


@lru_cache(maxsize=2)
def grammar_tokenizer(model_dir: Path, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (its tokenizer.json) over `vocab_size` logits (the model's, which
    may pad past the tokenizer). 0.2–1.5 s to build: once per process, on its first structured request.
    NOTE: its own end-of-sequence guess is not used: a request's end ids (Sampling.end_ids) are (TokenGrammar)."""
    text = (Path(model_dir) / "tokenizer.json").read_text()
    return llguidance.LLTokenizer(text, n_vocab=vocab_size)


class GrammarCache:
    """Compiled grammars by their text (LRU); a request gets its own copy, positioned at the completion's start."""

    def __init__(self, size: int = GRAMMAR_CACHE_SIZE):
        self.size = size
        self._compiled: OrderedDict[tuple[int, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: a worker compiles on its torch thread; tests may call from others
        self.num_compiled = 0

    def matcher(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        key = (id(tokenizer), grammar)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = llguidance.LLMatcher(tokenizer, grammar)
                if compiled.is_error():
                    raise GrammarError(f"the grammar does not compile: {compiled.get_error()}")
                self.num_compiled += 1
                self._compiled[key] = compiled
                while len(self._compiled) > self.size:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
            return compiled.deep_copy()


CACHE = GrammarCache()  # one per process: a worker's grammars


class TokenGrammar:
    """One request's grammar state: which tokens may come next, given the completion tokens it has consumed."""

    def __init__(self, model_dir: Path, vocab_size: int, end_ids: Sequence[int], grammar: str,
                 cache: GrammarCache = CACHE):
        tokenizer = grammar_tokenizer(Path(model_dir), vocab_size)
        self.matcher = cache.matcher(tokenizer, grammar)
        self.grammar_end_ids = list(tokenizer.eos_tokens)  # what llguidance takes for the end: replaced by end_ids
        self.vocab_size = vocab_size
        self.end_ids = tuple(end_ids)
        self.num_consumed = 0  # completion tokens 0…num_consumed-1 have advanced the matcher
        self._words = llguidance.torch.allocate_token_bitmask(1, vocab_size)  # (1, ⌈vocab/32⌉) int32 bit words

    def follow(self, completion: Sequence[int]) -> None:
        """Advance the matcher over the completion tokens it has not seen yet (sampled here or elsewhere)."""
        for token in completion[self.num_consumed:]:
            if not self.matcher.consume_token(token):
                raise GrammarError(f"completion token {self.num_consumed} ({token}) breaks the grammar: "
                                   f"{self.matcher.get_error()}")
            self.num_consumed += 1

    def is_complete(self, completion: Sequence[int]) -> bool:
        """After `completion`: the grammar allows nothing more but the end (the answer is done)."""
        self.follow(completion)
        return self.matcher.is_stopped()

    def allowed(self, completion: Sequence[int]) -> torch.Tensor:
        """After `completion`: a (vocab_size,) bool mask of the tokens the grammar allows next."""
        self.follow(completion)
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._words, 0)
        bits = (self._words[0, :, None] >> _BITS) & 1  # (words, 32)
        allowed = bits.reshape(-1)[: self.vocab_size].bool()
        # the end: the request's end ids, where the answer so far is complete (and the grammar's own guess never)
        is_accepting = not self.matcher.is_error() and self.matcher.is_accepting()
        allowed[self.grammar_end_ids] = False
        if self.end_ids:
            allowed[list(self.end_ids)] |= is_accepting
        if self.matcher.is_error() or not allowed.any():
            # NOTE: a grammar with no way on (its language is empty, e.g. a regex no text matches): the answer ends
            # here, as one the grammar completed would, rather than failing the request mid-way
            if not self.end_ids:
                raise GrammarError(f"the grammar cannot go on and there is no end token: {self.matcher.get_error()}")
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[list(self.end_ids)] = True
        return allowed

    def accepts(self, token: int) -> bool:
        """Whether the parser takes `token` next (after the completion `masked` was given): an end id the mask allowed
        always is; any other token is checked without consuming it."""
        return token in self.end_ids or self.matcher.validate_tokens([token]) == 1

    def dead_end(self) -> int:
        """The token that ends an answer the grammar cannot carry on (an end id), or GrammarError without one."""
        if not self.end_ids:
            raise GrammarError(f"the grammar cannot go on and there is no end token: {self.matcher.get_error()}")
        return self.end_ids[0]

    def masked(self, logits: torch.Tensor, completion: Sequence[int]) -> torch.Tensor:
        """logits (vocab,) with every token the grammar does not allow next set to -inf."""
        allowed = self.allowed(completion).to(logits.device)
        return logits.float().masked_fill(~allowed[: logits.shape[-1]], float("-inf"))
