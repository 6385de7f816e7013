"""Token ids → text deltas, with OpenAI `stop` strings, as tokens arrive one by one.

Bounded work per token (it runs on the gateway's event loop, beside every other stream): the text is decoded
incrementally (only the last few tokens are decoded again, as TGI and vLLM do: a window from `prefix_at` that
lets a multi-token character or a merged space settle), and stop strings are looked for only where the new text
could have completed one: the delta plus the longest stop string's length before it. So a token costs
O(its text + the stop strings' length), never O(the whole answer). Stop strings themselves are bounded at
validation (services/gateway/requests.py MAX_STOP_STRINGS, MAX_STOP_CHARS).
"""
from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str], include_stop: bool = False):
        """`include_stop` (vLLM's include_stop_str_in_output): a matched stop string stays at the end of the text."""
        self.tokenizer, self.stop, self.include_stop = tokenizer, [s for s in stop if s], include_stop
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # the answer's text so far (settled characters only)
        self.emitted = ""  # text already handed to the client (a prefix of `text`)
        self.is_stopped = False  # a stop string was found; nothing more will be emitted
        # incremental decoding: tokens from prefix_at on are decoded again each time; read_at is where the text
        # last settled (text up to it is in `text`)
        self._prefix_at = self._read_at = 0

    def add(self, token_id: int) -> str:
        """Take one token; return the text that can be sent now (possibly "")."""
        if self.is_stopped:
            return ""
        self.token_ids.append(token_id)
        new = self._settle()
        if not new:  # an incomplete character (or a token with no text): wait for the next token
            return ""
        searched_from = max(0, len(self.text) - self.longest_stop + 1)  # a stop ending in `new` starts here or later
        self.text += new
        window = self.text[searched_from:]
        found = [(at, at + len(s)) for s in self.stop if (at := window.find(s)) != -1]
        if found:
            self.is_stopped = True
            start, end = min(found)
            return self._emit(self.text[: searched_from + (end if self.include_stop else start)])
        # hold back a tail that could still become a stop string
        return self._emit(self.text[: len(self.text) - self._hold()])

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (and the last tokens, settled or not)."""
        if self.is_stopped:
            return ""
        rest = self._decode(self._prefix_at, len(self.token_ids))[len(self._decode(self._prefix_at, self._read_at)):]
        self.text += rest
        return self._emit(self.text)

    def _settle(self) -> str:
        """The text the tokens since the last settle add, once it is whole characters ("" meanwhile)."""
        before = self._decode(self._prefix_at, self._read_at)
        after = self._decode(self._prefix_at, len(self.token_ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self.token_ids)
        return after[len(before):]

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:stop], skip_special_tokens=True) if stop > start else ""

    def _hold(self) -> int:
        """The length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self.text[-self.longest_stop:] if self.longest_stop else ""
        return max((next((k for k in range(min(len(s) - 1, len(tail)), 0, -1) if tail.endswith(s[:k])), 0)
                    for s in self.stop), default=0)

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta
