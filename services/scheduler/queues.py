"""The waiting queue under each scheduling policy.

fcfs: arrival order; a preempted request goes back to the front, so it resumes first.
priority: lowest (priority, arrival) first; a preempted request keeps its key, so it too
resumes ahead of everything that came after it at the same priority.
"""

from __future__ import annotations

import heapq
from collections import deque

from services.scheduler.request import Request


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        # Entries (priority, arrival_seq, request); arrival_seq is unique, so requests are never compared.
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_seq, request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (entry[2] for entry in sorted(self._heap))


def make_waiting_queue(policy: str) -> FcfsQueue | PriorityQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (use fcfs or priority)")
