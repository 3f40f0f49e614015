"""The native prefill attention kernel (cpu_kernels/prefill_attention.c) against float64 attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import library
from services.worker.cpu_kernels.library import PREFILL_PATHS
from services.worker.setup.cpu_features import cpu_flags

pytestmark = pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the prefill kernel needs AVX-512F")

CODES = {torch.float32: 0, torch.bfloat16: 1}
# float32: summation order only. bfloat16: the output is rounded once (inputs are exact in float32).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def lib():
    return library.load_prefill()


def attend(lib, seqs, H, KV, D, block_size, dtype, threads=2, seed=0, magnitude=1.0):
    """Runs the kernel on sequences of (cached tokens, query rows) with shuffled block tables, queries in a
    wider qkv-like buffer, queries and keys ``magnitude`` times standard normal; returns (kernel output,
    float64 reference), both [T, H * D]."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = (torch.randn(num_blocks, block_size, KV, D, generator=g) * magnitude).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KV, D, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 2, dtype=torch.int32)  # padded, as the runner's
    at = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[at : at + n]
        at += n
    num_rows = sum(q for _, q in seqs)
    # The queries sit first in wider rows, as in the step's qkv buffer.
    qkv = (torch.randn(num_rows, (H + 2 * KV) * D, generator=g) * magnitude).to(dtype)
    starts = torch.tensor([0] + [q for _, q in seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in seqs], dtype=torch.int32)
    out = torch.full((num_rows, H * D), float("nan"), dtype=dtype)
    scale = D**-0.5
    lib.kvp_set_num_threads(threads)
    failed = lib.kvp_prefill_attention(
        qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), starts.data_ptr(), out.data_ptr(), out.stride(0), len(seqs), H, KV, D, block_size, scale,
        CODES[dtype],
    )  # fmt: skip
    assert failed == 0
    expected = torch.empty(num_rows, H * D, dtype=torch.float64)
    for i, (cached, q_len) in enumerate(seqs):
        length = cached + q_len
        blocks = tables[i, : blocks_per_seq[i]].long()

        def context(cache, blocks=blocks, length=length):  # [H, length, D], KV heads repeated per query head
            kv = cache[blocks].reshape(-1, KV, D)[:length].double().transpose(0, 1)
            return kv.repeat_interleave(H // KV, dim=0)

        rows = slice(int(starts[i]), int(starts[i + 1]))
        query = qkv[rows, : H * D].double().view(q_len, H, D).transpose(0, 1)
        visible = torch.arange(length)[None, :] <= torch.arange(q_len)[:, None] + cached
        got = F.scaled_dot_product_attention(query, context(k_cache), context(v_cache), attn_mask=visible, scale=scale)
        expected[rows] = got.transpose(0, 1).reshape(q_len, H * D)
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "H, KV, D, block_size",
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 128, 16), (16, 2, 32, 7), (6, 6, 256, 32)],
    ids=["smollm2", "mha-d16", "mqa-d128", "odd-block", "d256"],
)
def test_matches_float64_attention(lib, dtype, H, KV, D, block_size):
    # Rows not a multiple of 16, chunks after cached tokens (a diagonal that starts mid-tile), a sequence
    # of many key tiles, single rows, and a longest-first task order over unequal sequences.
    seqs = [(0, 1), (0, 5), (0, 16), (0, 17), (3, 20), (40, 33), (0, 150), (130, 1), (7, 64)]
    out, expected = attend(lib, seqs, H, KV, D, block_size, dtype)
    assert not out.isnan().any()  # every row written
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.fixture
def paths(lib):
    """The paths this CPU runs for bfloat16 caches: float32 FMAs, AMX tiles and AVX512-BF16 dot products where it
    has them (an AMX CPU has both); each test leaves the fastest in use."""
    available = [name for i, name in enumerate(PREFILL_PATHS) if lib.kvp_select_path(i) == i]
    lib.kvp_select_path(PREFILL_PATHS.index("amx"))
    yield available
    lib.kvp_select_path(PREFILL_PATHS.index("amx"))


@pytest.mark.parametrize(
    "H, KV, D, block_size", [(9, 3, 64, 16), (8, 1, 128, 32), (4, 2, 96, 16)], ids=["smollm2", "mqa-d128", "d96"]
)
def test_each_bfloat16_path_matches_float64_attention(lib, paths, H, KV, D, block_size):
    """The float32 path, the AMX tiles (blocks of a multiple of 16 tokens, D a multiple of 32: 16 keys of a block a
    tile, up to four output tiles at a time) and the AVX512-BF16 dot products (four keys at a time, 16 output
    elements at a time) give the same attention to bfloat16's tolerance; each runs where the CPU has it."""
    seqs = [(0, 1), (0, 17), (3, 20), (40, 33), (0, 150), (130, 1), (7, 64)]
    outs = {}
    for name in paths:
        assert lib.kvp_select_path(PREFILL_PATHS.index(name)) == PREFILL_PATHS.index(name)
        outs[name], expected = attend(lib, seqs, H, KV, D, block_size, torch.bfloat16)
        assert not outs[name].isnan().any()
        torch.testing.assert_close(outs[name].double(), expected, atol=8e-3, rtol=8e-3)
    for name in set(outs) - {"float32"}:  # bfloat16 products ran: their weights are not the float32 path's bits
        assert not torch.equal(outs[name], outs["float32"])


@pytest.mark.parametrize("name", ["amx", "avx512-bf16"])
def test_bfloat16_thread_counts_agree(lib, paths, name):
    """Each thread configures its own tiles (AMX), the sequences' transposed values are shared by its tasks (both):
    one thread and three give the same bits."""
    if name not in paths:
        pytest.skip(f"this CPU does not run the {name} path")
    lib.kvp_select_path(PREFILL_PATHS.index(name))
    seqs = [(0, 37), (12, 50), (0, 3)]
    one, _ = attend(lib, seqs, 9, 3, 64, 16, torch.bfloat16, threads=1)
    three, _ = attend(lib, seqs, 9, 3, 64, 16, torch.bfloat16, threads=3)
    assert torch.equal(one, three)


def test_thread_counts_agree(lib):
    """Tasks are independent: one thread and three give the same bits."""
    seqs = [(0, 37), (12, 50), (0, 3)]
    one, _ = attend(lib, seqs, 9, 3, 64, 16, torch.float32, threads=1)
    three, _ = attend(lib, seqs, 9, 3, 64, 16, torch.float32, threads=3)
    assert torch.equal(one, three)


def test_large_scores(lib):
    """Scores in the hundreds (the max is subtracted before exp): rows whose weight sits on a few keys."""
    out, expected = attend(lib, [(0, 40), (9, 24)], 4, 2, 32, 8, torch.float32, seed=5, magnitude=6.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H, KV, D", [(18, 1, 64), (4, 2, 24), (2, 1, 272), (5, 2, 64), (4, 0, 64)])
def test_refuses_shapes_it_does_not_take(lib, H, KV, D):
    """More than 8 query heads per KV head, head sizes not a multiple of 16 or past 256, uneven groups, no KV
    heads: -2 before touching any buffer (all pointers here are null)."""
    scratch = torch.zeros(2, dtype=torch.int32)
    status = lib.kvp_prefill_attention(
        None, 0, None, None, None, 0, scratch.data_ptr(), scratch.data_ptr(), None, 0, 1, H, KV, D, 16, 1.0, 0
    )
    assert status == -2
