"""The triton attention backend: selection, device guard, and greedy parity with the torch backend.

Here (no CUDA) the kernels run in the Triton interpreter on CPU tensors, which the backend accepts
only because they were built for it.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference import kv_cache_write_reference, paged_attention_reference
from services.worker.attention import AttentionMetadata, get_backend
from services.worker.attention.triton_backend import TritonAttentionBackend, TritonUnavailable

from .batches import DEVICE, MIXED, random_batch


def test_auto_picks_triton_on_cuda_only():
    assert get_backend("auto", "cpu").name == "torch"
    if torch.cuda.is_available():
        assert isinstance(get_backend("auto", "cuda:0"), TritonAttentionBackend)
        with pytest.raises(TritonUnavailable, match="--attention-backend torch"):
            get_backend("triton", "cpu")  # native kernels cannot take CPU tensors
    else:  # auto chose triton for CUDA, which refuses at construction: these kernels are interpreted
        with pytest.raises(TritonUnavailable, match="interpreter"):
            get_backend("auto", "cuda:0")
        assert isinstance(get_backend("triton", "cpu"), TritonAttentionBackend)


def test_refuses_devices_it_cannot_run_on():
    with pytest.raises(TritonUnavailable, match="meta"):
        TritonAttentionBackend("meta")
    backend = TritonAttentionBackend()  # no device given: checked when tensors arrive
    query = torch.zeros(1, 1, 64, device="meta")
    cache = torch.zeros(1, 16, 1, 64, device="meta")
    with pytest.raises(TritonUnavailable, match="meta"):
        backend.write_kv(query, query, cache, cache, torch.zeros(1, dtype=torch.int64, device="meta"))
    native = TritonAttentionBackend()
    native._interpreted = False  # as if TRITON_INTERPRET were unset: CPU tensors need the torch backend
    with pytest.raises(TritonUnavailable, match="CUDA devices .* --attention-backend torch"):
        native.write_kv(*(torch.zeros(1, 1, 64),) * 2, *(torch.zeros(1, 16, 1, 64),) * 2, torch.zeros(1).long())


def _metadata(batch) -> AttentionMetadata:
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    block_size = batch.k_cache.shape[1]
    slots = []  # the new tokens' slots: last q_len positions of each request
    for i, seq_len in enumerate(seq_lens):
        for pos in range(seq_len - (starts[i + 1] - starts[i]), seq_len):
            slots.append(int(batch.block_tables[i, pos // block_size]) * block_size + pos % block_size)
    return AttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=batch.max_query_len,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[b - a for a, b in zip(starts, starts[1:], strict=False)],
        seq_lens_cpu=seq_lens,
    )


def test_write_then_attend_matches_references():
    batch = random_batch(MIXED, 6, 2, 64, 16, torch.float32, seed=5)
    meta = _metadata(batch)
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(batch.query.shape[0], 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(batch.query.shape[0], 2, 64, generator=gen).to(DEVICE)
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    kv_cache_write_reference(key, value, expected_k, expected_v, meta.slot_mapping)

    backend = TritonAttentionBackend()
    backend.write_kv(key, value, batch.k_cache, batch.v_cache, meta.slot_mapping)
    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, meta, 0.125)
    expected = paged_attention_reference(*batch.args(), 0.125, batch.max_query_len)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _generate(runner, prompts: list[list[int]], arrivals: list[int], num_new: int, chunk: int) -> list[list[int]]:
    """Greedy decoding with chunked prefill; request i joins at step arrivals[i], so steps mix
    prefill chunks and decodes. Each request owns a fixed scattered set of blocks."""
    from tests.worker.tiny import request

    perm = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    per_request = -(-(max(map(len, prompts)) + num_new) // runner.block_size)
    states = [request(f"r{i}", p, perm[i * per_request : (i + 1) * per_request], 0, 0) for i, p in enumerate(prompts)]
    step = 0
    while any(len(s.token_ids) < len(p) + num_new for s, p in zip(states, prompts, strict=True)):
        active = []
        for s, p, arrival in zip(states, prompts, arrivals, strict=True):
            if step >= arrival and len(s.token_ids) < len(p) + num_new:
                s.num_scheduled_tokens = min(chunk, len(s.token_ids) - s.num_computed_tokens)
                active.append(s)
        runner.execute(active)
        step += 1
    return [s.token_ids[len(p) :] for s, p in zip(states, prompts, strict=True)]


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_torch_backend(tmp_path):
    """The worker's own runner and tiny random Llama (GQA 4:2), once per backend, same greedy tokens."""
    from services.worker.setup.build import create_runner, load_model
    from tests.worker.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "tiny"), "llama", seed=3)
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 33)]
    outputs = {}
    for name in ("torch", "triton"):
        loaded = load_model(path, dtype="float32", device=DEVICE, attention_backend=name)
        assert loaded.model.layers[0].self_attn.backend.name == name
        runner = create_runner(loaded, block_size=16, num_blocks=24)
        outputs[name] = _generate(runner, prompts, arrivals=[0, 1, 3], num_new=6, chunk=8)
    assert all(len(tokens) == 6 for tokens in outputs["triton"])
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.timeout(300)
def test_sliding_window_model_greedy_tokens_equal_torch_backend(tmp_path):
    """Gemma 3 (two layers over a window of 8, one global) through each backend: prompts past the window,
    chunked prefills starting beyond it, small blocks so windows start mid-block."""
    from services.worker.setup.build import create_runner, load_model
    from tests.worker.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "gemma3"), "gemma3", seed=5)
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 21, 30)]
    outputs = {}
    for name in ("torch", "triton"):
        loaded = load_model(path, dtype="float32", device=DEVICE, attention_backend=name)
        assert [layer.self_attn.window for layer in loaded.model.layers] == [8, 8, 0]
        runner = create_runner(loaded, block_size=4, num_blocks=40)
        outputs[name] = _generate(runner, prompts, arrivals=[0, 1, 3], num_new=6, chunk=8)
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.timeout(300)
def test_decode_graphs_give_the_eager_tokens(tmp_path):
    """Decode steps through ``DecodeGraphs`` (captured on CUDA; here the same static, padded buffers run
    eagerly) give the eager runner's greedy tokens, while batches grow and shrink across graph sizes."""
    from services.worker.setup.build import create_runner, load_model
    from tests.worker.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "tiny"), "llama", seed=4)
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17)]
    outputs, replays = {}, []
    for graphs in (False, True):
        loaded = load_model(path, dtype="float32", device=DEVICE, attention_backend="triton")
        runner = create_runner(loaded, block_size=16, num_blocks=24)
        if graphs:
            runner.use_decode_graphs(max_num_seqs=4, max_model_len=256, capture=DEVICE == "cuda")
            assert runner.graphs.sizes == [1, 2, 4]
            run = runner.graphs.run
            runner.graphs.run = lambda ids, pos, meta, run=run: replays.append(meta.num_seqs) or run(ids, pos, meta)
        outputs[graphs] = _generate(runner, prompts, arrivals=[0, 1, 2], num_new=9, chunk=8)
    assert all(len(tokens) == 9 for tokens in outputs[True])
    assert outputs[True] == outputs[False]
    assert {1, 2, 3} <= set(replays)  # 3 requests pad to the 4-row graph; 1 and 2 fit theirs exactly
