"""The Llama forward pass on the native CPU kernels, for every step: decodes, prefill chunks, both.

At batch 1 a decode step on a CPU is ~120 matrix-vector products plus ~20 small ops per layer.
torch's bfloat16 matrix-vector product falls well short of the memory bandwidth, and each small
eager op pays torch's dispatch, more than its own math at batch 1;
``cpu_kernels/decode_kernels.c`` streams the weights at close to bandwidth and does each small op
in one call, 9 calls per layer. A decode-only step whose products all take native kernels (batch 1
on packed weights, a few rows on the GEMV, decode batches on AMX tiles) runs all its layers in one call
(``kvg_decode_layers``, described by ``llama_one_call``: the same kernels in the same order, from C, without the Python
between them, a fifth of such a step); at one row on weights in the quantized kernel's tiled formats
that call runs the whole step as one OpenMP team, each thread streaming its share of every product
(a seventh faster again). Norms, rotary embedding and the cache write always run here, and
so does paged attention over the block tables for decodes, and for prefill chunks too where the
CPU has AVX-512 (``cpu_kernels/prefill_attention.c``, which reads the context from the blocks in
place where SDPA needs it gathered first); elsewhere prefill chunks attend through the attention
backend (SDPA). Even in a long prefill chunk, where the matmuls dominate, the small ops in torch
and the copies between them cost a share of the step that the native ones mostly remove. Matmuls
pick their kernel by row count (``Linear.gemm``, the weight packed at load): float32 weights take
the native GEMV for one row and MKL's GEMM on packed weights above (written straight into this
path's buffers, and ahead of the GEMV from two rows); bfloat16 weights on a CPU with bfloat16
units take the native GEMV on bfloat16 pairs (AVX512-BF16) for a few rows, where it streams the
weights faster than any GEMM, and oneDNN's GEMM on weights reordered for those units above
(``cpu_kernels.onednn_gemm``; at every row count where the GEMV can only widen to float32); where the
CPU has AMX-BF16, products up to ``tile_gemm.MAX_ROWS`` rows take AMX tiles instead, and where it has
AVX512-BF16 without AMX, the same tiled copy on bfloat16 dot products, from one row
(``cpu_kernels.tile_gemm``, into this path's buffers, from the one-call step too). Without a packed
GEMM, the native GEMV up to a few rows and torch's GEMM above (compute-bound there, where MKL is
faster); ``gemv_rows`` holds every limit. Packed weights (``--quantization``) take
``quant.matmul``. Same weights, same KV cache, same numerics op for op (see the C files).
"""

from __future__ import annotations

import ctypes

import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.cpu_kernels import decode_step
from services.worker.cpu_kernels.library import (
    DTYPE_CODES,
    PREFILL_PATHS,
    NativeKernelsUnavailable,
    load_prefill,
    load_quant,
)
from services.worker.cpu_kernels.tile_gemm import TileGemm
from services.worker.models import llama_one_call as one_call
from services.worker.models.gemv_rows import GemvRows
from services.worker.quant.formats import FORMAT_CODES
from services.worker.quant.matmul import DEQUANTIZE_ROWS, linear_into, packed_linear, takes_amx


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _row(t: torch.Tensor, i: int) -> int:
    """The address of row (or element, for 1-D) ``i`` of ``t``."""
    return t.data_ptr() + i * t.stride(0) * t.element_size()


class NativeCpuPath:
    """Holds the model's own modules (no weight copies); valid while the model keeps its parameters. Which kernel
    each product takes is decided once per row count: whoever changes the modules' GEMMs calls ``forget_plans``."""

    def __init__(self, model, lib: ctypes.CDLL):
        a = model.args
        dtype = model.embed_tokens.weight.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype_name not in DTYPE_CODES:
            raise ValueError(f"the native CPU kernels take float32 or bfloat16 weights, not {dtype}")
        if a.head_dim % 2 or a.head_dim > 1024 or a.num_heads % a.num_kv_heads:
            raise ValueError(
                f"the native CPU kernels take an even head_dim up to 1024 and a whole number of query heads per"
                f" KV head, not head_dim {a.head_dim} with {a.num_heads} query and {a.num_kv_heads} KV heads"
            )
        for p in model.parameters():
            if not p.is_contiguous() or p.device.type != "cpu":
                raise ValueError("the native CPU kernels need contiguous CPU weights")
        self.lib, self.model = lib, model
        self.rows = GemvRows.for_dtype(dtype)  # up to which products take the native GEMV
        self.prefill_lib, self.prefill_path = _prefill_kernel(a.head_dim, a.num_heads // a.num_kv_heads)
        if any(a.layer_windows):  # the native prefill kernel reads whole contexts: windowed chunks go to the backend
            self.prefill_lib, self.prefill_path = None, "SDPA (sliding-window layers)"
        self.dtype, self.code = dtype, DTYPE_CODES[dtype_name]
        self.hidden, self.intermediate = a.hidden_size, a.intermediate_size
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_width = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.eps = a.rms_norm_eps
        self.scale = a.head_dim**-0.5
        self._scratch: tuple[torch.Tensor, ...] = ()
        self._packed_calls: dict[torch.nn.Module, tuple] = {}
        self._program: tuple[tuple[int, ...], decode_step.StepModel, ctypes.Array] | None = None
        self._in_one_call: dict[int, bool] = {}  # by rows

    def scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Per-step intermediates (normed, qkv, attention out, gate_up, activation): the first ``rows`` rows
        of buffers kept at the largest step seen (a prefill chunk's rows change every step)."""
        if not self._scratch or self._scratch[0].shape[0] < rows:
            shapes = (self.hidden, self.qkv_width, self.heads * self.head_dim, 2 * self.intermediate, self.intermediate)
            self._scratch = tuple(torch.empty(rows, n, dtype=self.dtype) for n in shapes)
        return tuple(buffer[:rows] for buffer in self._scratch)

    def matmul_path(self) -> str:
        """Which kernels the matmuls take by row count, for the log."""
        if self.model.logits_module.packed is not None:
            return "packed weights through the quantized linear (see the CPU line)"
        return self.rows.describe(self.model.logits_gemm)

    def linear(self, module, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
        """out (+)= module(x), out's rows possibly strided: the kernel for this row count and weight. Returns the
        tensor holding the product: ``out``, or, not accumulating, a GEMM's own output where the GEMM returns one
        (oneDNN's: copying it into ``out`` cost as much as a small product, ~6 ms of a 64-row bfloat16 step)."""
        rows = x.shape[0]
        if module.packed is not None and (rows < DEQUANTIZE_ROWS or takes_amx(module.packed, x)):
            if rows == 1 and self.packed_gemv(module, x, out, accumulate):
                return out
            linear_into(x, module.packed, module.bias, out, accumulate)
            return out
        if module.packed is None and self.rows.takes_gemv(module.gemm, rows):
            n, k = module.weight.shape
            self.lib.kvg_linear(
                x.data_ptr(), module.weight.data_ptr(), _ptr(module.bias), out.data_ptr(), out.stride(0), rows, n, k,
                self.code, int(accumulate),
            )  # fmt: skip
            return out
        gemm = module.gemm
        if isinstance(gemm, TileGemm):
            if gemm.takes(rows):  # adds as below, in the kernel
                gemm.into(x, out, module.bias, accumulate)
                return out
            gemm = gemm.large  # oneDNN's, below: its own output, not a copy of it
        if gemm is not None and out.dtype == gemm.dtype:  # a GEMM on the weight packed at load
            if accumulate:  # rounded, then added, as torch's path (MKL's own accumulation would round differently)
                out.add_(gemm(x, module.bias))
            elif gemm.writes_into:
                gemm.into(x, out, module.bias)
            else:
                return gemm(x, module.bias)
            return out
        product = module.forward(x)  # a GEMM: torch's (bf16 weights upcast, packed ones dequantized per call)
        out.add_(product) if accumulate else out.copy_(product)
        return out

    def packed_gemv(self, module, x: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> bool:
        """One row through the quantized linear with the call's constant arguments prepared once per
        weight (``linear_into`` re-derives them in Python on every call, a cost that shows at batch 1, where the
        products are short: ``benchmarks/worker_bench.py --quantization gguf --batch-sizes 1``);
        False when the weight is not in the kernels' tiled layout. Threads: set once per step."""
        packed = module.packed
        cached = self._packed_calls.get(module)
        if cached is None or cached[0] is not packed:
            if not packed.tiled:
                return False
            n, k = packed.shape
            weights = (packed.data.data_ptr(), _ptr(packed.scales), _ptr(getattr(module, "bias", None)))
            cached = (packed, load_quant().kvq_linear, weights, (n, k, FORMAT_CODES[packed.format], self.code))
            self._packed_calls[module] = cached
        _, kernel, (w, scales, bias), (n, k, fmt, dt) = cached
        kernel(x.data_ptr(), w, scales, bias, out.data_ptr(), out.stride(0), 1, n, k, fmt, dt, int(accumulate))
        return True

    def forget_plans(self) -> None:
        """The decisions kept per row count and the layers' description, for a model whose products changed."""
        self._in_one_call.clear()
        self._program = None

    def in_one_call(self, rows: int) -> bool:
        """Whether every product of a decode step of ``rows`` rows takes a kernel that ``kvg_decode_layers`` calls:
        the native GEMV or AMX tile GEMM for float weights, the quantized kernel for one row of tiled packed ones
        (no other GEMM, no int8 GEMM: those only Python calls)."""
        if rows not in self._in_one_call:
            self._in_one_call[rows] = one_call.all_native(self.model.layers, self.rows.takes_gemv, rows)
        return self._in_one_call[rows]

    def layers_program(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> decode_step.StepModel:
        """The layers' weights, norms and caches as ``kvg_decode_layers`` reads them, built once per set of caches."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._program is None or self._program[0] != key:
            self._program = (key, *one_call.describe(self, kv_caches))  # the array too: the struct points into it
        return self._program[1]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E] hidden states before the final norm
        """Any step. Only attention tells the kinds apart: a decode-only step calls the paged kernel
        itself; a step with prefill chunks goes through the attention backend (SDPA per chunk, its
        decodes on the same paged kernel through ``attention``)."""
        lib, dt = self.lib, self.code
        backend = None if meta.is_decode_only else self.model.layers[0].self_attn.backend
        lib.kvg_set_num_threads(torch.get_num_threads())
        rows = input_ids.shape[0]
        if self.model.logits_module.packed is not None:  # --quantization: packed_gemv's threads
            load_quant().kvq_set_num_threads(torch.get_num_threads())
        E, I, H, KV, D = self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim
        hidden = self.model.embed_tokens.forward(input_ids)  # the residual stream
        normed, qkv_buffer, attn, gate_up_buffer, act = self.scratch(rows)
        h, n, q, o, gu, ac = (t.data_ptr() for t in (hidden, normed, qkv_buffer, attn, gate_up_buffer, act))
        cos, sin = self.model.cos.data_ptr(), self.model.sin.data_ptr()
        pos, slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        tables, lens, table_width = meta.block_tables.data_ptr(), meta.seq_lens.data_ptr(), meta.block_tables.shape[1]
        block_size = kv_caches[0][0].shape[1]
        width = self.qkv_width
        if backend is None and self.in_one_call(rows):
            buffers = decode_step.StepBuffers(h, n, q, o, gu, ac)
            program = self.layers_program(kv_caches)
            lib.kvg_decode_layers(
                ctypes.byref(program), ctypes.byref(buffers), rows, pos, slots, tables, table_width, lens
            )
            return hidden
        num_decodes = 0  # a mixed step's leading run of decodes
        if backend is not None and self.prefill_lib is not None:
            self.prefill_lib.kvp_set_num_threads(torch.get_num_threads())
            num_decodes = meta.num_leading_decodes
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            kc, vc = k_cache.data_ptr(), v_cache.data_ptr()
            lib.kvg_rms_norm(h, layer.input_layernorm.weight.data_ptr(), n, rows, E, self.eps, dt)
            qkv = self.linear(attention.qkv_proj, normed, qkv_buffer)  # [rows, width], contiguous either way
            q = qkv.data_ptr()
            lib.kvg_rope_write_kv(q, width, cos, sin, pos, slots, kc, vc, rows, H, KV, D, dt)
            if backend is None:
                lib.kvg_decode_attention(
                    q, width, kc, vc, tables, table_width, lens, o, H * D, rows, H, KV, D, block_size, self.scale, dt,
                    attention.window,
                )  # fmt: skip
                out = attn
            elif self.prefill_lib is not None:
                self.mixed_attention(meta, num_decodes, qkv, k_cache, v_cache, attn)
                out = attn
            else:  # the query rows sit in qkv, rotated in place
                query = qkv[:, : H * D].view(rows, H, D)
                out = backend.forward(query, k_cache, v_cache, meta, self.scale, attention.window)
                out = out.reshape(rows, H * D)
            self.linear(attention.o_proj, out, hidden, accumulate=True)
            lib.kvg_rms_norm(h, layer.post_attention_layernorm.weight.data_ptr(), n, rows, E, self.eps, dt)
            gate_up = self.linear(mlp.gate_up_proj, normed, gate_up_buffer)
            lib.kvg_silu_mul(gate_up.data_ptr(), ac, rows, I, dt)
            self.linear(mlp.down_proj, act, hidden, accumulate=True)
        return hidden

    def mixed_attention(self, meta: AttentionMetadata, num_decodes: int, qkv, k_cache, v_cache, out) -> None:
        """A step with prefill chunks: its leading decodes on the paged decode kernel, every later
        request (prefill chunks, any decode after one) on the prefill kernel, both straight over the
        block tables; out [T, H * D]."""
        H, KV, D, dt = self.heads, self.kv_heads, self.head_dim, self.code
        width, block_size = qkv.stride(0), k_cache.shape[1]
        kc, vc = k_cache.data_ptr(), v_cache.data_ptr()
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        if num_decodes:
            self.lib.kvg_decode_attention(
                qkv.data_ptr(), width, kc, vc, tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(),
                H * D, num_decodes, H, KV, D, block_size, self.scale, dt, 0,
            )  # fmt: skip
        rest = meta.num_seqs - num_decodes
        if rest:
            status = self.prefill_lib.kvp_prefill_attention(
                _row(qkv, num_decodes), width, kc, vc, _row(tables, num_decodes), tables.shape[1],
                _row(lens, num_decodes), _row(starts, num_decodes), _row(out, num_decodes), H * D, rest, H, KV, D,
                block_size, self.scale, dt,
            )  # fmt: skip
            if status == -1:
                raise MemoryError("prefill attention could not allocate its work buffers")
            if status:
                raise ValueError(f"prefill attention does not take {H} heads over {KV} KV heads of {D}")

    def attention(
        self,
        query: torch.Tensor,  # [B, H, D], rows of any stride
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        num_seqs: int,  # the first B requests of the step, one new token each
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:  # [B, H, D]
        """Paged decode attention for the decodes of a mixed step (``TorchAttentionBackend.native_decode``)."""
        return paged_decode(self.lib, self.code, query, k_cache, v_cache, meta, num_seqs, scale, window)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, E] -> [R, vocab]
        model = self.model
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        normed = torch.empty_like(hidden)
        self.lib.kvg_set_num_threads(torch.get_num_threads())
        self.lib.kvg_rms_norm(hidden.data_ptr(), model.norm.weight.data_ptr(), normed.data_ptr(), rows, self.hidden,
                              self.eps, self.code)  # fmt: skip
        module = model.logits_module
        if module.packed is not None:
            if rows >= DEQUANTIZE_ROWS:
                return packed_linear(normed, module.packed)
            out = torch.empty(rows, module.packed.shape[0], dtype=self.dtype)
            load_quant().kvq_set_num_threads(torch.get_num_threads())
            if rows != 1 or not self.packed_gemv(module, normed, out):
                linear_into(normed, module.packed, None, out)
            return out
        weight = module.weight
        if not self.rows.takes_gemv(model.logits_gemm, rows):
            return model.unpacked_logits(normed)
        vocab = weight.shape[0]
        out = torch.empty(rows, vocab, dtype=self.dtype)
        self.lib.kvg_linear(normed.data_ptr(), weight.data_ptr(), None, out.data_ptr(), vocab, rows, vocab,
                            self.hidden, self.code, 0)  # fmt: skip
        return out


def paged_decode(
    lib: ctypes.CDLL,  # the decode kernels (cpu_kernels.library.load)
    code: int,  # the dtype's (DTYPE_CODES)
    query: torch.Tensor,  # [B, H, D], rows of any stride
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_seqs: int,  # the first B requests of the step, one new token each
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [B, H, D]
    """The native paged decode attention over the block tables: no gather of whole contexts, no mask."""
    _, heads, head_dim = query.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    out = torch.empty(num_seqs, heads, head_dim, dtype=query.dtype)
    lib.kvg_set_num_threads(torch.get_num_threads())
    lib.kvg_decode_attention(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(),
        meta.block_tables.shape[1], meta.seq_lens.data_ptr(), out.data_ptr(), heads * head_dim,
        num_seqs, heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, code, window,
    )  # fmt: skip
    return out


class PagedDecode:
    """``paged_decode`` as a ``TorchAttentionBackend.native_decode`` for models whose layers run in torch
    (not on ``NativeCpuPath``): their decodes skip the backend's gather and SDPA."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype):
        self.lib, self.code = lib, DTYPE_CODES[str(dtype).removeprefix("torch.")]

    def __call__(self, query, k_cache, v_cache, meta: AttentionMetadata, num_seqs: int, scale: float, window: int = 0):
        return paged_decode(self.lib, self.code, query, k_cache, v_cache, meta, num_seqs, scale, window)


def _prefill_kernel(head_dim: int, group: int) -> tuple[ctypes.CDLL | None, str]:
    """The native prefill attention where this CPU and shape take it, else None (SDPA); and which, for the log."""
    if head_dim % 16 or head_dim > 256 or group > 8:
        return None, (
            "SDPA (the native kernel takes head_dim a multiple of 16 up to 256 and at most 8 query heads per KV"
            f" head, not {head_dim} and {group})"
        )
    try:
        lib = load_prefill()
    except NativeKernelsUnavailable as exc:
        return None, f"SDPA ({exc})"
    fastest = PREFILL_PATHS[lib.kvp_select_path(PREFILL_PATHS.index("amx"))]  # which it uses from now on
    if head_dim % 32 or fastest == "float32":
        return lib, "native (AVX-512)"
    units = "AMX tiles" if fastest == "amx" else "AVX512-BF16 dot products"
    return lib, f"native (AVX-512; {units} for bfloat16 caches)"
