"""The native CPU path as a whole model: its logits equal the torch path's at decode, prefill and mixed
steps, and the worker attaches it (or says why not) as the CPU and dtype allow. The kernels one by one:
test_cpu_kernels.py."""

from __future__ import annotations

import logging

import pytest
import torch

from services.worker.cpu_kernels import library, tile_gemm
from services.worker.setup.build import create_runner, load_model
from services.worker.setup.cpu_features import cpu_flags
from services.worker.setup.cpu_features import detect as detect_cpu
from services.worker.setup.loader import ModelLoadError
from tests.worker.test_cpu_kernels import DTYPES, TOLERANCE
from tests.worker.tiny import drop_packed_gemms, request, run_logits, save_tiny_model


@pytest.fixture(params=sorted(DTYPES))
def dtype(request):
    return DTYPES[request.param]


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
@pytest.mark.parametrize("num_requests", [3, 20])
@pytest.mark.parametrize("packed_gemms", [True, False])
def test_model_decode_steps_equal_torch_path(tmp_path, dtype, kind, overrides, num_requests, packed_gemms):
    """Prefill in torch, then decode steps: native logits == torch logits, step by step.

    With the weights packed at load the matmuls around native attention take their GEMM (float32 from 2 rows,
    bfloat16 with bfloat16 units at every row count); without, 3 requests take the native GEMV (at most
    ``gemv_rows``: 4 for bfloat16 with bfloat16 units, else 16) and 20 torch's GEMM."""
    dt, _ = dtype
    path = save_tiny_model(str(tmp_path), kind, **overrides)
    loaded = load_model(path, dtype=str(dt).removeprefix("torch."), device="cpu", attention_backend="torch")
    if not packed_gemms:
        drop_packed_gemms(loaded.model)
    native = loaded.model.native_path
    assert native is not None, "auto should attach the native kernels on an AVX2 CPU with a C compiler"
    num_blocks = 6 * num_requests
    runner = create_runner(loaded, block_size=4, num_blocks=num_blocks)
    g = torch.Generator().manual_seed(12)
    lengths = [3 + (5 * i) % 12 for i in range(num_requests)]
    blocks = [list(range(i, num_blocks, num_requests)) for i in range(num_requests)]  # interleaved blocks
    requests = [
        request(f"r{i}", torch.randint(0, 160, (n,), generator=g).tolist(), blocks[i], 0, n)
        for i, n in enumerate(lengths)
    ]
    loaded.model.set_native_path(None)
    run_logits(runner, requests)  # prefill on the torch path
    for _step in range(6):
        for r in requests:
            r.token_ids.append(int(torch.randint(0, 160, (1,), generator=g)))
            r.num_scheduled_tokens = 1
        inputs = runner.prepare(requests)
        with torch.inference_mode():
            loaded.model.set_native_path(None)
            expected = runner.compute_logits(inputs)
            loaded.model.set_native_path(native)  # rewrites the same cache slots with the same values
            ours = runner.compute_logits(inputs)
        if num_requests <= native.rows.native and loaded.model.logits_gemm is None:  # the native GEMV's: model dtype
            assert ours.dtype == dt
        torch.testing.assert_close(ours.float(), expected.float(), **TOLERANCE[dt])
        if dt == torch.float32:  # bf16 logits of a random tiny model tie within rounding
            assert torch.equal(ours.argmax(-1), expected.argmax(-1))
        for r in requests:
            r.num_computed_tokens += 1
            r.num_scheduled_tokens = 0


@pytest.fixture(params=["native", "sdpa"])
def prefill_attention(request):
    """How chunks attend: the native prefill kernel (CPUs with AVX-512F) or the backend's SDPA."""
    if request.param == "native" and "avx512f" not in cpu_flags():
        pytest.skip("the native prefill attention kernel needs AVX-512F")
    return request.param


def test_prefill_and_mixed_steps_equal_torch_path(tmp_path, dtype, prefill_attention):
    """Every step runs on the native kernels: prompts in chunks, then a step of decodes, a second chunk
    (queries after cached tokens) and a new prompt. The decodes take the paged decode kernel; the chunks
    the native prefill kernel (straight over the block tables) or, without it, the backend (SDPA). The
    native path writes the cache in its rope kernel, never through the backend."""
    dt, _ = dtype
    loaded = load_model(
        save_tiny_model(str(tmp_path)), dtype=str(dt).removeprefix("torch."), device="cpu", attention_backend="torch"
    )
    native = loaded.model.native_path
    if prefill_attention == "sdpa":
        native.prefill_lib = None
    else:
        assert native.prefill_lib is not None and native.prefill_path.startswith("native (AVX-512")
    runner = create_runner(loaded, block_size=4, num_blocks=60)
    g = torch.Generator().manual_seed(13)
    lengths = [5, 8, 11, 30, 14]
    requests = [request(f"r{i}", torch.randint(0, 160, (n,), generator=g).tolist(), list(range(i, 60, 5)), 0, n)
                for i, n in enumerate(lengths)]  # fmt: skip
    requests[3].num_scheduled_tokens = 12  # the long prompt in two chunks
    backend = loaded.model.layers[0].self_attn.backend
    calls = []
    backend.write_kv = lambda *args, write=backend.write_kv: calls.append("write_kv") or write(*args)
    # Per layer, the decodes each kernel took: the prefill kernel's step (its decodes) or the backend's.
    native.mixed_attention = lambda meta, num_decodes, *args, run=native.mixed_attention: (
        calls.append(("native", num_decodes)) or run(meta, num_decodes, *args)
    )

    def step(batch, query_lens, decodes):
        inputs = runner.prepare(batch)
        assert inputs.meta.query_lens_cpu == query_lens
        with torch.inference_mode():
            loaded.model.set_native_path(None)
            expected = runner.compute_logits(inputs)
            calls.clear()
            loaded.model.set_native_path(native)  # rewrites the same cache slots, rounded its own way
            backend.native_decode = lambda *args: calls.append(("sdpa", args[4])) or native.attention(*args)
            ours = runner.compute_logits(inputs)
        if prefill_attention == "native":
            assert calls == [("native", decodes)] * loaded.args.num_layers
        else:
            assert calls == [("sdpa", decodes)] * loaded.args.num_layers if decodes else calls == []
        torch.testing.assert_close(ours.float(), expected.float(), **TOLERANCE[dt])
        for r in batch:
            r.num_computed_tokens += r.num_scheduled_tokens
            r.num_scheduled_tokens = 0

    step(requests[:4], [5, 8, 11, 12], decodes=0)  # prompts only
    for r in requests[:3]:
        r.token_ids.append(int(torch.randint(0, 160, (1,), generator=g)))
        r.num_scheduled_tokens = 1
    requests[3].num_scheduled_tokens = 18
    step(requests, [1, 1, 1, 18, 14], decodes=3)  # three decodes, the long prompt's second chunk, a new prompt


def test_engine_choice(tmp_path, monkeypatch, caplog):
    path = save_tiny_model(str(tmp_path / "m"))
    assert load_model(path, dtype="float32", device="cpu", cpu_kernels="torch").model.native_path is None
    # float16 is not a dtype the kernels take: auto says why and keeps torch, native refuses to start.
    with caplog.at_level(logging.INFO, logger="services.worker.setup.build"):
        assert load_model(path, dtype="float16", device="cpu", cpu_kernels="auto").model.native_path is None
    assert "native CPU kernels unavailable" in caplog.text and "float16" in caplog.text
    with pytest.raises(ModelLoadError, match="--cpu-kernels native: .*float16"):
        load_model(path, dtype="float16", device="cpu", cpu_kernels="native")

    # bfloat16 weights take oneDNN's GEMM on weights reordered at load where the CPU has bfloat16 units (the tile GEMM
    # up to 512 rows where a tile kernel runs: AMX-BF16, or AVX512-BF16), below 5 rows (1 ahead of AMX tiles, none
    # ahead of the AVX512-BF16 tiles) the native GEMV where it multiplies bfloat16 pairs; elsewhere they are
    # multiplied in float32, on MKL's packed GEMM from 2 rows.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="services.worker.setup.build"):
        assert load_model(path, dtype="bfloat16", device="cpu", cpu_kernels="auto").model.native_path is not None
    tiles = library.tile_path()
    gemm = tile_gemm.describe() if tiles else "oneDNN's reordered bfloat16"
    if detect_cpu().bf16_units and library.linear_path() == "avx512-bf16" and tiles != "avx512-bf16":
        pairs = "the native GEMV on bfloat16 pairs " + ("at 1 row" if tiles == "amx" else "up to 4 rows")
        assert f"matmuls: {pairs}, the GEMM on {gemm} weights above" in caplog.text
    elif detect_cpu().bf16_units:
        assert f"matmuls: the GEMM on {gemm} weights at every row count" in caplog.text
    else:
        assert "matmuls: the native GEMV at 1 row, the GEMM on MKL's packed float32 weights above" in caplog.text

    # No working compiler and nothing built yet.
    monkeypatch.setenv("KVGRID_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    library.load.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match="--cpu-kernels native: false failed to build decode_kernels.c"):
            load_model(path, dtype="float32", device="cpu", cpu_kernels="native")
        assert load_model(path, dtype="float32", device="cpu", cpu_kernels="auto").model.native_path is None
    finally:
        library.load.cache_clear()
