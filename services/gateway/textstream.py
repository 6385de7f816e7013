"""Token ids → text deltas, with OpenAI `stop` strings, as tokens arrive one by one."""
from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.token_ids: list[int] = []
        self.emitted = ""  # text already handed to the client
        self.is_stopped = False  # a stop string was found; nothing more will be emitted

    def add(self, token_id: int) -> str:
        """Take one token; return the text that can be sent now (possibly "")."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                self.is_stopped = True
                return self._emit(text[:at])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        # hold back a tail that could still become a stop string
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(text[: len(text) - hold])

    def flush(self) -> str:
        """At the end of the stream: whatever was held back."""
        if self.is_stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta
