"""Group choice: which worker group (scheduler) runs a request, and the engine client over all of them.

A group is scored by how much of the prompt its prefix cache holds (the
scheduler's own block hashes, published on its Connect stream, see GroupView)
against its load (running + waiting requests, and KV usage). When loads are
badly imbalanced (the busiest group has more than ``balance_abs_threshold``
requests more than the idlest, and more than ``balance_rel_threshold`` times as
many) load alone decides. Ties go to the group that rendezvous hashing of the
prompt's first block picks, so frontend replicas that see the same state choose
the same group without talking to each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvgrid.v1 import common_pb2, worker_pb2
from services.common.block_hash import cache_salt, chain_hash, prompt_block_hashes
from services.common.config import RoutingConfig
from services.common.errors import AlreadyExists, Unavailable
from services.common.tls import TlsFiles
from services.tokenizer.discovery import is_literal, resolve_named
from services.tokenizer.engine_client import SchedulerClient
from services.tokenizer.model_state import ModelState
from services.tokenizer.request_handle import RequestHandle

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class Candidate:
    """One group as the policy sees it."""

    addr: str
    load: int  # running + waiting requests
    kv_cache_usage: float
    matched: int  # leading prompt blocks the group holds


def rendezvous(route_key: int, addr: str) -> int:
    """The same on every frontend (unlike ``hash`` of a str, which each process salts)."""
    return int.from_bytes(hashlib.blake2b(f"{route_key}|{addr}".encode(), digest_size=8).digest())


def choose(candidates: Sequence[Candidate], num_blocks: int, route_key: int, config: RoutingConfig) -> Candidate:
    loads = [c.load for c in candidates]
    lo, hi = min(loads), max(loads)
    if hi - lo > config.routing_balance_abs_threshold and hi > config.routing_balance_rel_threshold * lo:
        # Badly imbalanced: the idlest groups only, the one holding more of the prompt first.
        return max((c for c in candidates if c.load == lo), key=lambda c: (c.matched, rendezvous(route_key, c.addr)))

    def score(c: Candidate) -> tuple[float, int]:
        value = (
            config.routing_prefix_weight * c.matched / max(num_blocks, 1)
            - config.routing_load_weight * c.load / max(hi, 1)
            - config.routing_kv_weight * c.kv_cache_usage
        )
        return round(value, 9), rendezvous(route_key, c.addr)

    return max(candidates, key=score)


class GroupState:
    """One group's health as its SchedulerLink reports it; the frontend's ModelState serves while any group does."""

    def __init__(self, model: ModelState, on_change):
        self.model = model
        self.info: worker_pb2.HandshakeResponse | None = None
        self.serving = False
        self._on_change = on_change

    async def set_worker_info(self, info: worker_pb2.HandshakeResponse) -> None:
        self.info = info
        await self.model.set_worker_info(info)

    def set_scheduler_serving(self, serving: bool) -> None:
        self.serving = serving
        self._on_change()


class Group:
    def __init__(self, addr: str, model: ModelState, on_change, tls: TlsFiles | None = None, server_name: str = ""):
        self.addr = addr
        self.state = GroupState(model, on_change)
        self.client = SchedulerClient(addr, self.state, tls, server_name)

    @property
    def available(self) -> bool:
        return self.state.serving and self.client.connected

    @property
    def block_size(self) -> int:
        info = self.state.info
        return self.client.view.block_size or (info.block_size if info is not None else 0) or DEFAULT_BLOCK_SIZE


class Router:
    """The frontend's engine client over every scheduler of the deployment (same interface as SchedulerClient):
    ``submit`` picks a group, the returned handle talks to that group alone."""

    def __init__(self, addrs: list[str], state: ModelState, config: RoutingConfig, tls: TlsFiles | None = None):
        self._spec = addrs
        self._state = state
        self.config = config
        self._tls = tls  # mutual TLS toward every scheduler (None: plaintext)
        self.groups: dict[str, Group] = {}
        self._turn = 0
        self._refresh_task: asyncio.Task | None = None
        # Groups DNS no longer lists (e.g. a scheduler not ready while its worker restarts): out of rotation, but
        # their requests in flight go on (a restarted worker resumes them); closed once they have none.
        self._retired: dict[str, Group] = {}

    async def start(self) -> None:
        await self._update(await asyncio.to_thread(resolve_named, self._spec))
        if not all(is_literal(addr) for addr in self._spec) and self.config.scheduler_resolve_interval > 0:
            self._refresh_task = asyncio.create_task(self._refresh(), name="scheduler-resolve")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
        await asyncio.gather(*(group.client.close() for group in self._all()))

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        trace_context: dict[str, str],
        pooling: common_pb2.PoolingParams | None = None,
        mm_inputs: list[common_pb2.MultiModalInput] = (),
        lora: common_pb2.LoraRequest | None = None,
        deliver_at_finish: bool = False,
    ) -> RequestHandle:
        if any(group.client.has(request_id) for group in self._all()):
            raise AlreadyExists(f"request_id: a live request already has id {request_id!r}")
        group = self.pick(prompt_ids, lora.name if lora is not None else "")
        return await group.client.submit(
            request_id, prompt_ids, sampling, trace_context, pooling, mm_inputs, lora, deliver_at_finish
        )

    def abort(self, request_id: str) -> None:
        for group in self._all():
            if group.client.has(request_id):
                group.client.abort(request_id)

    def pick(self, prompt_ids: list[int], lora_name: str = "") -> Group:
        """The group for a prompt (of a LoRA adapter, ``lora_name``); a group that is down is passed over (all of
        them, when none is up). Among the groups, those already running the adapter are preferred."""
        groups = [group for group in self.groups.values() if group.available] or list(self.groups.values())
        if not groups:
            raise Unavailable("no scheduler to send the request to (--scheduler-addrs resolved to nothing)")
        if lora_name:  # the adapter's blocks and slot are there: no load from disk, no cold prefix cache
            groups = [g for g in groups if lora_name in g.client.view.lora_adapters] or groups
        if len(groups) == 1:
            return groups[0]
        salt = cache_salt(lora_name)
        if self.config.routing_policy == "round-robin":
            self._turn += 1
            return sorted(groups, key=lambda g: g.addr)[self._turn % len(groups)]
        hashes_by_size: dict[int, list[int]] = {}
        candidates = []
        for group in groups:
            size = group.block_size
            hashes = hashes_by_size.get(size)
            if hashes is None:
                hashes = hashes_by_size[size] = prompt_block_hashes(prompt_ids, size, salt)
            view = group.client.view
            load = max(view.reported_load, group.client.num_in_flight)
            candidates.append(Candidate(group.addr, load, view.kv_cache_usage, view.matched_blocks(hashes)))
        size = groups[0].block_size
        hashes = hashes_by_size[size]
        route_key = hashes[0] if hashes else chain_hash(None, tuple(prompt_ids[:size]))
        chosen = self.groups[choose(candidates, len(hashes), route_key, self.config).addr]
        log.debug("routed to %s among %s", chosen.addr, candidates)
        chosen.client.view.note_routed(hashes_by_size[chosen.block_size])
        return chosen

    def _all(self) -> list[Group]:
        return [*self.groups.values(), *self._retired.values()]

    async def _update(self, addrs: dict[str, str]) -> None:
        """``addrs``: each scheduler address with the DNS name it was resolved from (see ``resolve_named``)."""
        for addr, server_name in addrs.items():
            if addr in self._retired:
                self.groups[addr] = self._retired.pop(addr)
                log.info("scheduler group %s is back in rotation", addr)
            elif addr not in self.groups:
                group = self.groups[addr] = Group(addr, self._state, self._on_change, self._tls, server_name)
                group.client.start()
                log.info("scheduler group %s added", addr)
        for addr in [addr for addr in self.groups if addr not in addrs]:
            self._retired[addr] = self.groups.pop(addr)
            log.info("scheduler group %s is no longer resolved: out of rotation", addr)
        for addr, group in list(self._retired.items()):
            if group.client.num_in_flight == 0:
                del self._retired[addr]
                await group.client.close(f"the scheduler group {addr} was removed")
        self._on_change()

    def _on_change(self) -> None:
        self._state.set_scheduler_serving(any(group.state.serving for group in self.groups.values()))

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.scheduler_resolve_interval)
            await self._update(await asyncio.to_thread(resolve_named, self._spec))
