"""Token log-probabilities in OpenAI's two shapes: the completions route's parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`; with `echo`, the prompt's tokens first, the very first one
without a value) and the chat route's `content` list of {token, logprob, bytes, top_logprobs}.

A token's text is what the tokenizer decodes it to alone; two alternatives that decode to the same text share
one key of a completions `top_logprobs` dict (as in other OpenAI-compatible servers)."""
from __future__ import annotations

from typing import Any

from schemas import TokenLogprobs

# The prefill's reply (PrefillDone) carries the prompt's log-probabilities in one NATS message: about this many
# bytes per prompt token with k alternatives (msgpack, measured: 41 + 12.2·k), plus the message's own fields
ECHO_BYTES_PER_TOKEN = (48, 13)  # (fixed, per alternative), rounded up
ECHO_REPLY_OVERHEAD = 4096


def echo_problem(num_prompt_tokens: int, alternatives: int, max_payload: int) -> str:
    """Why `echo` with `logprobs` = `alternatives` cannot come back for a prompt of `num_prompt_tokens` ("" when
    it can): the prefill's reply must fit one NATS message of `max_payload` bytes (the server's limit)."""
    fixed, per_alt = ECHO_BYTES_PER_TOKEN
    per_token = fixed + per_alt * alternatives
    most = max(0, (max_payload - ECHO_REPLY_OVERHEAD) // per_token)
    if num_prompt_tokens <= most:
        return ""
    return (f"echo with logprobs {alternatives} returns the prompt's log-probabilities in one message of at most "
            f"{max_payload} bytes (the NATS server's max_payload): at most {most} prompt tokens at this many "
            f"alternatives, and this prompt has {num_prompt_tokens}; ask for fewer logprobs, a shorter prompt, or no "
            "echo")


def completion_logprobs(tokenizer, token_ids: list[int], scores: list[TokenLogprobs | None],
                        prompt_ids: list[int] | None = None, prompt_scores: list[TokenLogprobs] | None = None,
                        offset: int = 0) -> dict[str, Any]:
    """The completions route's `logprobs` object for `token_ids` (each scored by `scores`), preceded by the
    prompt's tokens when echoing (`prompt_ids`, token 0 unscored, then `prompt_scores`). `offset`: the text
    offset of the first token (a stream's later chunks)."""
    ids: list[int] = []
    entries: list[TokenLogprobs | None] = []
    if prompt_ids is not None:
        ids += prompt_ids
        entries += [None, *(prompt_scores or [])][: len(prompt_ids)]
        entries += [None] * (len(prompt_ids) - len(entries))
    ids += token_ids
    entries += scores
    texts = [_text(tokenizer, t) for t in ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts,
            "token_logprobs": [e.logprob if e is not None else None for e in entries],
            "top_logprobs": [{_text(tokenizer, t): lp for t, lp in zip(e.top_ids, e.top_logprobs)} if e is not None
                             else None for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], scores: list[TokenLogprobs | None]) -> dict[str, Any]:
    """The chat route's `logprobs` object: {"content": [...]} with one entry per token."""
    content = []
    for token, entry in zip(token_ids, scores):
        if entry is None:
            continue
        text = _text(tokenizer, token)
        content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (alt := _text(tokenizer, t)), "logprob": lp, "bytes": list(alt.encode())}
                                         for t, lp in zip(entry.top_ids, entry.top_logprobs)]})
    return {"content": content}


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
