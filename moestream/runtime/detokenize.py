"""Streaming detokenisation that never emits half a character, and stop strings that never leak.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a prefix yields
U+FFFD. We decode a short window of recent tokens and only emit text once it no longer ends in
U+FFFD (the incremental scheme used by serving engines such as vLLM and TGI).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # The prompt's last tokens are decoded as context, never emitted: SentencePiece-style
        # (Metaspace) tokenizers drop a word's leading space at the start of a decode, so without
        # them the first generated word would lose its space.
        self.ids: list[int] = [int(t) for t in (prompt_ids or [])[-6:]]
        if self.ids and self._decode(self.ids).endswith("\ufffd"):   # prompt ends inside a character
            self.ids = []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""


class StopStringFilter:
    """Holds back text that might be the start of a stop string; cuts output at the first match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended the text

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        if self.stops:
            search_from = max(0, self.emitted - max(len(s) for s in self.stops))
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                at, self.matched = min(hits)
                self.stopped = True
                self.text = self.text[:at]
                return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out

    def flush(self) -> str:
        return self._release(len(self.text))
