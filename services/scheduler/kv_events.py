"""What a scheduler tells its frontends for routing: its load and how its prefix cache changed.

The block pool reports each block hash that becomes findable or is evicted;
``KvEventLog`` nets them per hash between two publishes (a block stored and
evicted within one interval is simply removed), and the engine hands the result,
with the load, to every connected frontend stream after each step.
"""

from __future__ import annotations

from kvgrid.v1 import scheduler_pb2


class KvEventLog:
    """Prefix-cache changes since the last ``take``: hash value -> stored (True) or removed (False)."""

    def __init__(self) -> None:
        self.changes: dict[int, bool] = {}
        self.cleared = False
        self.block_size = 0
        self._last_load: tuple | None = None

    def record(self, value: int, stored: bool) -> None:
        self.changes[value] = stored

    def reset(self, block_size: int) -> None:
        """A new (or no) block pool: everything published so far is void."""
        self.changes.clear()
        self.cleared = True
        self.block_size = block_size

    def take(self, load: scheduler_pb2.GroupLoad) -> tuple[scheduler_pb2.GroupLoad | None, bool, dict[int, bool]]:
        """(the load if it changed, cleared, changes) since the previous take; resets the log."""
        key = (load.num_running, load.num_waiting, round(load.kv_cache_usage, 3))
        changed_load = load if key != self._last_load else None
        self._last_load = key
        out = (changed_load, self.cleared, self.changes)
        self.changes, self.cleared = {}, False
        return out


def fill_kv_events(events: scheduler_pb2.KvEvents, cleared: bool, changes: dict[int, bool], block_size: int) -> None:
    events.cleared = cleared
    events.block_size = block_size
    for value, stored in changes.items():
        (events.stored if stored else events.removed).append(value)
