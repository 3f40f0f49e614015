"""Host-tier slots are faulted in ahead of the first saves, in the background, without ever changing what a save
wrote: a save before, between or during the pre-fault's chunks reads back bit for bit."""

from __future__ import annotations

import resource

import torch

from kvgrid.v1 import worker_pb2
from services.worker.kv_transfer import HostTier, KvTransfer, host
from tests.kv_tiers.test_tier_copies import BLOCK_SIZE, Request, load_plan, random_cache, snapshot

# [3 layers, 2, 32768 slots, ...] of 256-byte blocks: 8 MiB per layer's K or V, 48 MiB in all; past glibc's
# largest mmap threshold (32 MiB), so always fresh pages, as a real tier's.
NUM_SLOTS = 1 << 15
CHUNK = 64 << 10


def tier_and_transfer() -> tuple[list, HostTier, KvTransfer]:
    caches = random_cache(torch.float32, one_allocation=True)
    tier = HostTier(caches, NUM_SLOTS)
    return caches, tier, KvTransfer(caches, BLOCK_SIZE, host=tier)


def save(transfer: KvTransfer, blocks: list[int], slots: list[int]) -> None:
    saves = [worker_pb2.KvTierBlock(block_id=b, host_slot=s) for b, s in zip(blocks, slots, strict=True)]
    transfer.apply(worker_pb2.StepPlan(step_id=1, kv_saves=saves), [])


def assert_loads_back(caches, transfer: KvTransfer, before, saved: dict[int, int]) -> None:
    """Every block in ``saved`` (block id -> slot) is overwritten, loaded back from its slot into another block
    and equals what it was."""
    sources = list(saved)
    targets = [b + 24 for b in sources]  # random_cache has 48 blocks; the saves use 0..23
    for k, v in caches:
        k[sources].fill_(float("nan"))
        v[sources].fill_(float("nan"))
    new = load_plan(targets, host_slots=[saved[b] for b in sources])
    assert transfer._load(new, Request(new.num_computed_tokens)) == 0
    after = snapshot(caches)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(after[target], before[source]), f"block {source} from slot {saved[source]}"


def test_saves_before_and_between_prefault_chunks_read_back_bit_for_bit(monkeypatch):
    caches, tier, transfer = tier_and_transfer()
    before = snapshot(caches)
    save(transfer, [0, 1, 2, 3], [32000, 32001, 32002, 32003])  # before: the last chunk of every span
    # After the first chunk (layer 0's K of slots 0..255 faulted in, nothing else): slots 0..3 have that span
    # faulted and the other five not; slots 2000.. have none faulted.
    chunks = []

    def populate_then_save(address: int, length: int) -> None:
        real_populate(address, length)
        if not chunks:
            save(transfer, [4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 2000, 2001, 2002, 2003])
        chunks.append(length)

    real_populate = host.populate
    monkeypatch.setattr(host, "populate", populate_then_save)
    assert not tier.prefaulted.is_set()
    assert tier.prefault(CHUNK) and tier.prefaulted.is_set()
    assert len(chunks) >= 48 * (1 << 20) // CHUNK  # every span, chunk by chunk
    save(transfer, [12, 13], [NUM_SLOTS - 1, 100])  # after
    saved = {0: 32000, 1: 32001, 2: 32002, 3: 32003, 4: 0, 5: 1, 6: 2, 7: 3, 8: 2000, 9: 2001, 10: 2002, 11: 2003}
    assert_loads_back(caches, transfer, before, {**saved, 12: NUM_SLOTS - 1, 13: 100})


def test_saves_while_the_background_prefault_runs_read_back_bit_for_bit():
    caches, tier, transfer = tier_and_transfer()
    before = snapshot(caches)
    thread = tier.start_prefault()
    assert thread is not None
    saved = {}
    for i in range(24):  # saves race the thread over the spans
        slot = (i * 7919) % NUM_SLOTS
        save(transfer, [i], [slot])
        saved[i] = slot
    assert tier.prefaulted.wait(30)
    thread.join(30)
    assert_loads_back(caches, transfer, before, saved)


def test_a_save_into_prefaulted_slots_faults_no_page_in():
    """The point of it: a save into fresh slots pays the kernel's page faults, into pre-faulted ones none."""

    def faults_of_a_save(prefault: bool) -> int:
        _, tier, transfer = tier_and_transfer()
        if prefault:
            assert tier.prefault()
        started = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        save(transfer, list(range(24)), [(i * 1361) % NUM_SLOTS for i in range(24)])
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - started

    # 24 blocks in 6 spans: at least one fault per 2 MiB page the saves land in (huge pages), up to one per block
    # and span (4 KiB pages); pre-faulted, at most a stray fault of the Python around the copies.
    fresh, prefaulted = faults_of_a_save(False), faults_of_a_save(True)
    assert fresh >= 12 and prefaulted <= fresh // 4, (fresh, prefaulted)


def test_without_madvise_the_tier_still_works_and_reports_done(monkeypatch):
    def unavailable(address: int, length: int) -> None:
        raise OSError(22, "madvise(MADV_POPULATE_WRITE): Invalid argument")

    monkeypatch.setattr(host, "populate", unavailable)
    caches, tier, transfer = tier_and_transfer()
    before = snapshot(caches)
    assert tier.prefault() is False and tier.prefaulted.is_set()
    assert tier.start_prefault() is None  # nothing left to do
    save(transfer, [0, 1], [7, 3000])
    assert_loads_back(caches, transfer, before, {0: 7, 1: 3000})
