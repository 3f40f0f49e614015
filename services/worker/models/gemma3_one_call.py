"""Gemma 3's decode steps as one native call: ``kvg_decode_layers`` with ``StepModel.gemma`` (``decode_layers.h``).

Gemma 3's layers run in torch, op by op, on the native kernels where it has them (norms, rotary, paged attention,
the quantized products): at one decode row ~20 calls a layer from Python, each its own OpenMP team, with the other
thread spinning between them, so on Gemma 3 270M Q4_K_M the layers took twice their products' time. A decode-only
step whose products all take a kernel the call makes (``llama_one_call.all_native``) runs its layers in one call
instead: the same kernels in the same order, except GELU, which torch computes with its own tanh (a bfloat16 value
now and then one step away, see ``kvg_gelu_tanh_mul``). Prefill chunks, mixed steps, tensor-parallel layers and LoRA
keep the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from services.worker.cpu_kernels import decode_step
from services.worker.cpu_kernels.library import DTYPE_CODES, load_quant
from services.worker.models import llama_one_call as one_call
from services.worker.models.gemv_rows import GemvRows


class GemmaDecodeCall:
    """Holds the model's own modules (no weight copies); valid while the model keeps its parameters. Whether a step
    of some row count takes the call is decided once per row count: whoever changes the products calls
    ``forget_plans``."""

    def __init__(self, model, lib: ctypes.CDLL):
        a = model.args
        self.lib, self.model = lib, model
        self.dtype = model.embed_tokens.weight.dtype
        self.code = DTYPE_CODES[str(self.dtype).removeprefix("torch.")]
        self.rows = GemvRows.for_dtype(self.dtype)
        self.hidden, self.intermediate = a.hidden_size, a.intermediate_size
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.qkv_width = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.eps = a.rms_norm_eps
        self.scale = model.layers[0].self_attn.scale
        self.packed = model.logits_module.packed is not None
        self._takes: dict[int, bool] = {}  # by rows
        self._program: tuple[tuple[int, ...], decode_step.StepModel, ctypes.Array] | None = None
        self._scratch: tuple[torch.Tensor, ...] = ()

    def forget_plans(self) -> None:
        """The decisions kept per row count and the layers' description, for a model whose products changed."""
        self._takes.clear()
        self._program = None

    def takes(self, x: torch.Tensor, meta) -> bool:
        """Whether this step's layers run in the call: a decode-only step of the model's dtype whose products all
        take a kernel the call makes, on layers without a tensor-parallel reduction."""
        if not meta.is_decode_only or x.dtype != self.dtype or not x.is_contiguous():
            return False
        rows = x.shape[0]
        if rows not in self._takes:
            layers = self.model.layers
            reduced = any(x.all_reduce is not None for layer in layers for x in (layer.self_attn, layer.mlp))
            self._takes[rows] = not reduced and one_call.all_native(layers, self.rows.takes_gemv, rows)
        return self._takes[rows]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta
    ) -> torch.Tensor:  # [T, E] the scaled embeddings in, the residual stream after the last layer out (in place)
        rows = x.shape[0]
        self.lib.kvg_set_num_threads(torch.get_num_threads())
        if self.packed:
            load_quant().kvq_set_num_threads(torch.get_num_threads())
        buffers = decode_step.StepBuffers(x.data_ptr(), *(t.data_ptr() for t in self.scratch(rows)))
        self.lib.kvg_decode_layers(
            ctypes.byref(self.program(kv_caches)), ctypes.byref(buffers), rows, positions.data_ptr(),
            meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(), meta.block_tables.shape[1],
            meta.seq_lens.data_ptr(),
        )  # fmt: skip
        return x

    def scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        """normed, qkv, attention out, gate_up, activation: the first ``rows`` rows of buffers kept at the largest
        step seen."""
        if not self._scratch or self._scratch[0].shape[0] < rows:
            shapes = (self.hidden, self.qkv_width, self.heads * self.head_dim, 2 * self.intermediate, self.intermediate)
            self._scratch = tuple(torch.empty(rows, n, dtype=self.dtype) for n in shapes)
        return tuple(buffer[:rows] for buffer in self._scratch)

    def program(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> decode_step.StepModel:
        """The layers as ``kvg_decode_layers`` reads them, built once per set of caches."""
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._program is None or self._program[0] != key:
            program, layers = one_call.describe(self, kv_caches)
            model = self.model
            for step_layer, layer in zip(layers, model.layers, strict=True):
                attention = layer.self_attn
                step_layer.input_norm = layer.input_layernorm.scale.data_ptr()
                step_layer.post_norm = layer.post_attention_layernorm.scale.data_ptr()
                step_layer.pre_ffn_norm = layer.pre_feedforward_layernorm.scale.data_ptr()
                step_layer.post_ffn_norm = layer.post_feedforward_layernorm.scale.data_ptr()
                step_layer.q_norm = attention.q_norm.scale.data_ptr()
                step_layer.k_norm = attention.k_norm.scale.data_ptr()
                cos, sin = (model.local_cos, model.local_sin) if attention.window > 0 else (model.cos, model.sin)
                step_layer.cos, step_layer.sin = cos.data_ptr(), sin.data_ptr()
            program.gemma = 1
            self._program = (key, program, layers)  # the array too: the struct points into it
        return self._program[1]
