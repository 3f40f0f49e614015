"""When `kvgrid serve` restarts a child that died: exponential backoff, and a limit on crashes in a window.

Pure arithmetic over the times of a child's crashes (tests feed their own clock).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# More crashes than this within the window stop the stack: a child that keeps dying needs a person.
MAX_CRASHES = 5
WINDOW_S = 120.0


@dataclass(slots=True)
class RestartPolicy:
    first_backoff: float = FIRST_BACKOFF_S
    max_backoff: float = MAX_BACKOFF_S
    max_crashes: int = MAX_CRASHES
    window: float = WINDOW_S
    _crashes: deque[float] = field(default_factory=deque)

    def crashed(self, now: float) -> float | None:
        """Record a crash at ``now``; the seconds to wait before restarting, or None when it crashed too often."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window:
            self._crashes.popleft()
        if len(self._crashes) > self.max_crashes:
            return None
        return min(self.first_backoff * 2 ** (len(self._crashes) - 1), self.max_backoff)

    @property
    def num_recent(self) -> int:
        return len(self._crashes)
