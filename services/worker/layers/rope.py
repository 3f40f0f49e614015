"""Rotary position embeddings: inverse frequencies for the scaling variants Llama-family configs use.

The cos/sin tables are built once for every position up to the model's limit, in float32
(the same arithmetic Hugging Face uses per step), then cast to the model dtype.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeError(ValueError):
    """A rope_scaling configuration kvgrid does not implement."""


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies and the factor that scales cos and sin."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise RopeError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1 where the original frequencies are kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def cos_sin_tables(
    head_dim: int, theta: float, scaling: dict, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos: [max_positions, head_dim] as (cos, cos); sin: [max_positions, head_dim] as (-sin, sin), in ``dtype``.

    The sign of the first half is folded into the sin table, so rotate-half needs no negation."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim] from ``cos_sin_tables``.

    Rotate-half layout: x * cos + (x2, x1) * (-sin, sin)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)
