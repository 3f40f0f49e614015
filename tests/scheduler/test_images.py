"""Images in the scheduler: per-block image keys in the prefix cache and tier keys, and the encoder budget."""

from __future__ import annotations

import pytest

from services.common import kv_keys
from services.common.block_hash import mm_block_keys
from services.scheduler.prefix_hash import extend_block_hashes
from tests.scheduler.core import Driver, make_request, make_scheduler

IMG = 99  # the placeholder token
PROMPT = [1, 2] + [IMG] * 8 + [3, 4, 5]  # an image's run at positions 2..9 over blocks of 4: blocks 0, 1, 2


def image_request(rid: str, mm_hash: str, prompt: list[int] = PROMPT, offset: int = 2, length: int = 8):
    request = make_request(rid, prompt, max_tokens=2)
    request.mm_spans = [(offset, length, mm_hash)]
    return request


def test_a_block_key_names_each_image_it_overlaps_and_where_its_run_starts():
    spans = [(2, 8, "a"), (12, 4, "b")]
    assert mm_block_keys(spans, 0, 4) == (("a", 2),)
    assert mm_block_keys(spans, 8, 12) == (("a", -6),)
    assert mm_block_keys(spans, 10, 14) == (("b", 2),)
    assert mm_block_keys(spans, 16, 20) == ()


def test_image_hashes_enter_the_blocks_they_cover_and_every_block_after():
    a = extend_block_hashes([], PROMPT, 4, mm_spans=[(2, 8, "a")])
    b = extend_block_hashes([], PROMPT, 4, mm_spans=[(2, 8, "b")])
    plain = extend_block_hashes([], PROMPT, 4)
    assert [h.value for h in a] != [h.value for h in b]
    assert all(x.value != y.value for x, y in zip(a, b, strict=True))  # the chain carries it past the image
    assert all(x.value != y.value for x, y in zip(a, plain, strict=True))
    assert [h.value for h in a] == [h.value for h in extend_block_hashes([], PROMPT, 4, mm_spans=[(2, 8, "a")])]


def test_tier_keys_follow_the_image():
    a = kv_keys.extend_keys([], "ns", PROMPT, 4, 3, [(2, 8, "a")])
    b = kv_keys.extend_keys([], "ns", PROMPT, 4, 3, [(2, 8, "b")])
    assert a == kv_keys.extend_keys([], "ns", PROMPT, 4, 3, [(2, 8, "a")])
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_the_same_image_hits_the_prefix_cache_and_another_one_does_not():
    s = make_scheduler(num_blocks=32, block_size=4)
    d = Driver(s)
    s.add_request(image_request("first", "a"))
    d.run()
    s.add_request(image_request("same", "a"))
    s.add_request(image_request("other", "b"))
    out, _ = d.step()
    computed = {p.request.request_id: p.num_computed_tokens for p in out.new_requests}
    assert computed == {"same": 12, "other": 0}
    d.run()


def test_an_image_that_does_not_fit_the_encoder_budget_waits_for_the_next_step():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    d = Driver(s)
    s.add_request(image_request("a", "x"))  # 13 tokens, an 8-token image at 2
    s.add_request(image_request("b", "y", prompt=[7] + [IMG] * 9 + [8], offset=1, length=9))
    out, _ = d.step()
    # a's image costs 8 of the encoder budget of 16; b's (9) does not fit the 8 left, so b's first chunk stops
    # before it, at its one text token, though the token budget had room for 3.
    assert [(p.request.request_id, p.num_scheduled_tokens) for p in out.new_requests] == [("a", 13), ("b", 1)]
    out, _ = d.step()
    assert [(p.request.request_id, p.num_scheduled_tokens) for p in out.running] == [("a", 1), ("b", 10)]
    d.run()


def test_an_image_larger_than_the_budget_runs_alone():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    d = Driver(s)
    s.add_request(image_request("a", "x"))
    out, _ = d.step()
    assert [(p.request.request_id, p.num_scheduled_tokens) for p in out.new_requests] == [("a", 4)]
    d.run()


def test_a_text_model_refuses_images_at_admission():
    from kvgrid.v1 import common_pb2, scheduler_pb2
    from services.common.errors import InvalidArgument
    from services.scheduler.admission import AdmissionLimits, admit

    image = common_pb2.MultiModalInput(mm_hash="a", offset=1, length=2, shape=[1], pixel_values=b"\0" * 4)
    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2, 3, 4], mm_inputs=[image])
    limits = AdmissionLimits(max_model_len=64, num_blocks=8, block_size=4, vocab_size=100, max_waiting_requests=8)
    with pytest.raises(InvalidArgument, match="text only"):
        admit(msg, limits, live=(), num_waiting=0)
    limits.takes_images = True
    assert admit(msg, limits, live=(), num_waiting=0).mm_spans == [(1, 2, "a")]
    bad = scheduler_pb2.SubmitRequest(request_id="s", prompt_token_ids=[1, 2, 3, 4], mm_inputs=[image, image])
    with pytest.raises(InvalidArgument) as caught:
        admit(bad, limits, live=(), num_waiting=0)
    assert caught.value.field == "mm_inputs[1]"  # its run starts inside the first image's
