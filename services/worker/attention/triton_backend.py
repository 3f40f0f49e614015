"""The Triton attention backend: the CUDA path (and, for tests, CPU through TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata

# tl.dot and bfloat16 need Volta or newer; older GPUs stay on the torch backend.
_MIN_CAPABILITY = (7, 0)


class TritonUnavailable(RuntimeError):
    """The triton backend cannot run here (triton missing, or a device it does not support)."""


class TritonAttentionBackend(AttentionBackend):
    """Paged attention and KV-cache writes as Triton kernels (``kernels/``), one launch each per layer.

    Given the model's ``device``, it refuses an unsupported one at construction (worker start-up)
    rather than at the first step; tensors on another device are checked when they first arrive.
    """

    name = "triton"

    def __init__(self, device: str | torch.device | None = None) -> None:
        try:
            from triton.runtime.interpreter import InterpretedFunction

            from kernels.kv_cache_write import kv_cache_write
            from kernels.paged_attention import paged_attention, paged_attention_kernel
        except ImportError as exc:
            raise TritonUnavailable(
                f"the triton attention backend needs the triton package ({exc}); use --attention-backend torch"
            ) from exc
        self._kv_cache_write = kv_cache_write
        self._paged_attention = paged_attention
        # triton.jit decides at import whether kernels run natively (CUDA) or in the interpreter (CPU tensors).
        self._interpreted = isinstance(paged_attention_kernel, InterpretedFunction)
        self._checked_devices: set[torch.device] = set()
        if device is not None:
            self._check_device(torch.device(device))

    def _check_device(self, device: torch.device) -> None:
        if device in self._checked_devices:
            return
        if self._interpreted:
            if device.type != "cpu":
                raise TritonUnavailable(
                    f"the triton kernels were built for the interpreter (TRITON_INTERPRET=1), "
                    f"which runs on CPU tensors, not on {device}"
                )
        elif device.type != "cuda":
            raise TritonUnavailable(
                f"the triton attention backend runs on CUDA devices (or on CPU under TRITON_INTERPRET=1 "
                f"for tests), not on {device}; use --attention-backend torch"
            )
        elif torch.cuda.get_device_capability(device) < _MIN_CAPABILITY:
            raise TritonUnavailable(
                f"the triton attention backend needs CUDA compute capability >= {_MIN_CAPABILITY}, "
                f"{device} has {torch.cuda.get_device_capability(device)}; use --attention-backend torch"
            )
        self._checked_devices.add(device)

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        self._check_device(key.device)
        self._kv_cache_write(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self._check_device(query.device)
        return self._paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            meta.max_query_len,
            window=window,
        )
