"""Stop strings, matched on the text as it streams (the device stops on token ids only).

A stop string may span tokens, so the text that could be the start of one is held back until
the next chunk decides; what is emitted never contains a stop string, and the text after a
match is dropped, as OpenAI's API does."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._held = ""
        self.matched = False

    def push(self, text: str) -> str:
        """The text that can be emitted now; after a match (self.matched) the rest is dropped."""
        if self.matched:
            return ""
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.matched = True
            self._held = ""
            return buf[:cut]
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
