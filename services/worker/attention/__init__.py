"""Attention backends: ``torch`` (CPU and CUDA) and ``triton`` (CUDA; CPU only through the interpreter)."""

from __future__ import annotations

from services.worker.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(name: str, device: str) -> AttentionBackend:
    """``auto`` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        from services.worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch or triton)")
