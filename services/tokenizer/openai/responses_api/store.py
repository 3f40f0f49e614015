"""The in-memory store of finished responses, for ``GET /v1/responses/{id}`` and ``previous_response_id``.

Bounded in count and in age: past ``max_entries`` the oldest entry goes, and an entry older than ``max_age``
seconds is gone when next looked at. Each entry holds its response and the conversation that led to it (the
input items of every turn before and its own output), whose text fits the model's context: it was prompted.
Per frontend process: another replica, or a restart, does not know it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.config_requests import ResponsesConfig


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the Response object as answered
    conversation: list[dict]  # input items of every turn so far, then this response's output items
    stored_at: float = 0.0


@dataclass(slots=True)
class ResponseStore:
    max_entries: int
    max_age: float
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    @classmethod
    def from_config(cls, config: ResponsesConfig) -> ResponseStore:
        return cls(config.max_stored_responses, config.stored_response_max_age)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry`` (evicting the oldest past the bound); False when storing is off."""
        if not self.enabled:
            return False
        self._expire()
        entry.stored_at = self.clock()
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        """Entries are in storing order, so the expired ones are at the front."""
        oldest_kept = self.clock() - self.max_age
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at >= oldest_kept:
                break
            self._entries.popitem(last=False)
