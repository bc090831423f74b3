"""Stop strings, matched on the text as it streams (the device stops on token ids only).

A stop string may span tokens, so the text that could be the start of one is held back until
the next chunk decides; the text after a match is dropped, as OpenAI's API does.  What is
emitted never contains the stop string, unless the request asked for it with vLLM's
`include_stop_str_in_output`: then the text ends with the stop string that matched (the earliest
one in the text; of two starting at the same place, the first the request listed).  As in vLLM,
no stop string is matched in the text of a choice's first `min_tokens` tokens."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], *, include: bool = False, min_tokens: int = 0):
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._include = include
        self._min_tokens = min_tokens
        self._held = ""
        self.matched = False

    def push(self, text: str, tokens: int = 0) -> str:
        """The text that can be emitted now; after a match (self.matched) the rest is dropped.
        tokens: the choice's output tokens through this text (within min_tokens: not matched)."""
        if self.matched:
            return ""
        if tokens and tokens <= self._min_tokens:
            return text
        buf = self._held + text
        found = [(i, k) for k, i in enumerate(buf.find(s) for s in self._stops) if i >= 0]
        if found:
            cut, which = min(found)
            self.matched = True
            self._held = ""
            return buf[: cut + len(self._stops[which])] if self._include else buf[:cut]
        keep = 0  # the longest tail of buf that begins some stop string
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the stream: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.matched else held
