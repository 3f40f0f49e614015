"""The byte-moving half: a stored block reads back only as exactly the block asked for (anything else is rejected,
never loaded), and a plan asking for moves the worker cannot do is refused."""

from __future__ import annotations

import pytest
import torch

from kvgrid.v1 import worker_pb2
from services.common.errors import InvalidArgument
from services.worker.kv_transfer import HostTier, KvTransfer, layout

SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]
KEY, NS = "kvgrid:kv:ab12", "m|float32|bs=4|bytes=1024|layout=1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_round_trips_bit_for_bit(dtype):
    block = torch.randn(SHAPE).to(dtype)
    got = layout.decode(layout.encode(KEY, NS, block), KEY, NS, SHAPE, dtype)
    assert torch.equal(got.view(torch.uint8), block.view(torch.uint8))


def _corrupt(value: bytes) -> bytes:
    flipped = bytearray(value)
    flipped[-5] ^= 0x40
    return bytes(flipped)


@pytest.mark.parametrize(
    "mangle, reads_as, match",
    [
        (lambda v: v[:-1], (KEY, NS, SHAPE, torch.float32), "payload of"),  # truncated
        (lambda v: v[:20], (KEY, NS, SHAPE, torch.float32), "header"),  # truncated inside the header
        (_corrupt, (KEY, NS, SHAPE, torch.float32), "checksum"),
        (lambda v: b"garbage" + v, (KEY, NS, SHAPE, torch.float32), "not a kvgrid"),
        (lambda v: v, ("kvgrid:kv:other", NS, SHAPE, torch.float32), "key"),  # stored under a wrong key
        (lambda v: v, (KEY, NS.replace("m|", "other-model|"), SHAPE, torch.float32), "namespace"),
        (lambda v: v, (KEY, NS, (2, 2, 8, 2, 4), torch.float32), "shape"),  # another block size
        (lambda v: v, (KEY, NS, SHAPE, torch.bfloat16), "dtype"),
    ],
)
def test_a_value_that_is_not_the_block_asked_for_is_rejected(mangle, reads_as, match):
    value = layout.encode(KEY, NS, torch.randn(SHAPE))
    with pytest.raises(layout.BadBlock, match=match):
        layout.decode(mangle(value), *reads_as)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(saves=[worker_pb2.KvTierBlock(block_id=1, host_slot=2)]), "host slot 2"),
        (dict(saves=[worker_pb2.KvTierBlock(block_id=6, host_slot=0)]), "block id 6"),
        (dict(loads=[worker_pb2.KvTierBlock(block_id=0, redis_key="kvgrid:kv:00")]), "no redis tier"),
        (dict(loads=[worker_pb2.KvTierBlock(block_id=3, host_slot=0)]), "fill the blocks"),
    ],
)
def test_a_plan_with_tier_moves_the_worker_cannot_do_is_refused_before_anything_moves(bad, match):
    caches = [(torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)) for _ in range(2)]
    transfer = KvTransfer(caches, 4, host=HostTier(caches, 2))
    new = worker_pb2.NewRequest(request_id="r", block_ids=[0, 1], num_computed_tokens=4, kv_loads=bad.get("loads"))
    plan = worker_pb2.StepPlan(step_id=1, new_requests=[new], kv_saves=bad.get("saves"))
    with pytest.raises(InvalidArgument, match=match):
        transfer.check(plan)
    good = worker_pb2.NewRequest(request_id="r", block_ids=[0, 1], num_computed_tokens=4)
    good.kv_loads.add(block_id=0, host_slot=1)
    transfer.check(worker_pb2.StepPlan(step_id=1, new_requests=[good]))
