"""What a frontend knows of one scheduler (one worker group) for routing: its load and the prefix blocks it holds.

Filled from the ``load`` and ``kv_events`` of the scheduler's Connect messages.
Blocks of prompts this frontend routed to the group count as held for a while
before the scheduler confirms them, so a burst of requests sharing a new prefix
follows the first one instead of spreading before its prefill is cached.
"""

from __future__ import annotations

import time

from kvgrid.v1 import scheduler_pb2

# Seconds a routed prompt's blocks count as held without the scheduler's confirmation.
ROUTED_TTL_S = 10.0
# Unconfirmed routed blocks kept before expired ones are dropped.
MAX_ROUTED = 65536


class GroupView:
    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.block_size = 0
        self.cached: set[int] = set()
        self.lora_adapters: frozenset[str] = frozenset()  # the adapters of the group's running requests
        self._routed: dict[int, float] = {}  # hash -> until when it counts as held (monotonic seconds)

    @property
    def reported_load(self) -> int:
        return self.num_running + self.num_waiting

    def apply(self, message: scheduler_pb2.SchedulerMessage) -> None:
        if message.HasField("load"):
            load = message.load
            self.num_running, self.num_waiting = load.num_running, load.num_waiting
            self.kv_cache_usage = load.kv_cache_usage
            self.lora_adapters = frozenset(load.lora_adapters)
        if message.HasField("kv_events"):
            events = message.kv_events
            if events.cleared:
                self.cached.clear()
            if events.block_size:
                self.block_size = events.block_size
            self.cached.update(events.stored)
            self.cached.difference_update(events.removed)
            routed = self._routed
            if routed:
                for value in events.stored:
                    routed.pop(value, None)
                for value in events.removed:
                    routed.pop(value, None)

    def reset(self) -> None:
        """The stream broke: nothing known holds any more."""
        self.__init__()

    def note_routed(self, hashes: list[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        routed = self._routed
        if len(routed) > MAX_ROUTED:
            self._routed = routed = {h: t for h, t in routed.items() if t > now}
        until = now + ROUTED_TTL_S
        for value in hashes:
            if value not in self.cached:
                routed[value] = until

    def matched_blocks(self, hashes: list[int], now: float | None = None) -> int:
        """How many leading blocks of a prompt with these block hashes the group holds (or was just sent)."""
        now = time.monotonic() if now is None else now
        cached, routed = self.cached, self._routed
        matched = 0
        for value in hashes:
            if value not in cached and routed.get(value, 0.0) <= now:
                break
            matched += 1
        return matched
