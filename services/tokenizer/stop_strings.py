"""Stop strings over streamed text: found across token boundaries, never emitted.

Text that could still grow into a stop string (a suffix equal to the beginning of
one) is held back until the next delta shows whether it does. The text up to the
first stop string is emitted; the stop string and everything after it are not.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""  # received, not yet emitted; never contains a whole stop string
        self.stopped = False
        self.matched: str | None = None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def push(self, text: str, match: bool = True) -> str:
        """Add a text delta; returns the part that is safe to emit. Sets ``stopped`` on a match.

        With ``match`` False (before min_tokens), the text is emitted without looking for stop strings.
        """
        if self.stopped:
            return ""
        self._pending += text
        if not self._stops or not match:
            out, self._pending = self._pending, ""
            return out
        first = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.stopped, self.matched = True, first[1]
            out, self._pending = self._pending[: first[0]], ""
            return out
        keep = self._held_length()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of the request (no stop string seen): the held-back text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_length(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best
