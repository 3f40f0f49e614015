"""A transformers config from a GGUF file's metadata, for the architectures whose GGUF files kvgrid reads itself.

transformers' GGUF reader covers Llama, Qwen2 and Gemma 3 (kvgrid reads those through it), but reads Mixtral
(llama.cpp writes it as architecture ``llama`` with ``llama.expert_count``) as a dense Llama, and leaves Qwen3's
head size and Qwen3-MoE's expert width at its config defaults (128 and 768) instead of ``attention.key_length``
and ``expert_feed_forward_length``; Phi-3 follows the same path here for one reader of the fused tensors.
Here the metadata keys llama.cpp's converter writes per architecture become the Hugging Face config the
checkpoint would have had; the weights are then read by ``quant.gguf_weights.read_gguf``.

What a GGUF file does not record is what llama.cpp itself computes: Qwen3-MoE's top-k weights are rescaled to
sum to 1 (``expert_weights_norm`` when written) and every layer with expert tensors is a mixture of experts;
Mixtral's top-k weights always are.
"""

from __future__ import annotations

import struct
from typing import Any

_OWN = ("qwen3", "phi3", "qwen3moe")
# the model types of the configs built here: their weights are read by read_gguf too
OWN_MODEL_TYPES = ("qwen3", "phi3", "qwen3_moe", "mixtral")


def reads_itself(fields: dict[str, Any]) -> bool:
    """Whether kvgrid builds this GGUF's config and reads its weights itself (rather than transformers)."""
    arch = fields.get("general.architecture", "llama")
    return arch in _OWN or (arch == "llama" and int(fields.get("llama.expert_count", 0) or 0) > 0)


_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(path: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The file's scalar and string metadata by key (arrays skipped, not parsed: a vocabulary of 262k tokens
    costs gguf's reader seconds), and each tensor's shape (outermost first)."""
    with open(path, "rb") as f:

        def unpack(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path!r}: truncated GGUF header")
            return struct.unpack("<" + fmt, data)[0]

        def string() -> str:
            return f.read(unpack("Q")).decode("utf-8", errors="replace")

        if f.read(4) != b"GGUF" or unpack("I") < 2:
            raise ValueError(f"{path!r} is not a GGUF file of version 2 or later")
        num_tensors, num_fields = unpack("Q"), unpack("Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key, kind = string(), unpack("I")
            if kind == _STRING:
                fields[key] = string()
            elif kind in _SCALARS:
                fields[key] = unpack(_SCALARS[kind])
            elif kind == _ARRAY:
                item, count = unpack("I"), unpack("Q")
                if item == _STRING:
                    for _ in range(count):
                        f.seek(unpack("Q"), 1)
                elif item in _SCALARS:
                    f.seek(count * struct.calcsize(_SCALARS[item]), 1)
                else:
                    raise ValueError(f"{path!r}: GGUF array of value type {item} in {key!r}")
            else:
                raise ValueError(f"{path!r}: unknown GGUF value type {kind} in {key!r}")
        shapes = {}
        for _ in range(num_tensors):
            name = string()
            dims = [unpack("Q") for _ in range(unpack("I"))]
            unpack("I"), unpack("Q")  # type, offset
            shapes[name] = tuple(reversed(dims))  # GGUF lists dims innermost first
        return fields, shapes


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.99999974e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def _rope_parameters(fields: dict[str, Any], arch: str, theta: float, shapes) -> dict[str, Any]:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if "rope_factors_long.weight" in shapes:  # Phi-3's long-context scaling: its factors are tensors
        return {"rope_type": "longrope", "rope_theta": theta}
    if kind in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": kind, "rope_theta": theta, "factor": _decimal(fields[f"{arch}.rope.scaling.factor"])}
    if f"{arch}.rope.scaling.original_context_length" in fields:
        params["original_max_position_embeddings"] = int(fields[f"{arch}.rope.scaling.original_context_length"])
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{key}" in fields:
            params[name] = _decimal(fields[f"{arch}.rope.scaling.{key}"])
    return params


def hf_config_from_gguf(fields: dict[str, Any], shapes: dict[str, tuple[int, ...]]):
    """The transformers config of a GGUF file ``reads_itself`` accepts; ValueError for a file it cannot describe."""
    import transformers

    arch = fields.get("general.architecture", "llama")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing")
        return value

    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise ValueError("the GGUF file has no token_embd tensor")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    layers = int(get("block_count"))
    theta = _decimal(get("rope.freq_base", 10000.0))
    common = dict(
        vocab_size=int(embed[0]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count") or 0)
        or hidden // heads,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope_parameters(fields, arch, theta, shapes),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    if arch == "phi3":
        if int(get("rope.dimension_count", hidden // heads)) != hidden // heads:
            raise ValueError("partial rotary embeddings are not supported")
        common.pop("head_dim")
        window = int(fields.get("phi3.attention.sliding_window", 0) or 0)
        original = int(fields.get("phi3.rope.scaling.original_context_length", common["max_position_embeddings"]))
        return transformers.Phi3Config(
            **common,
            sliding_window=window or None,
            original_max_position_embeddings=original,
            pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
            architectures=["Phi3ForCausalLM"],
        )
    experts, used = int(get("expert_count")), int(get("expert_used_count"))
    if arch == "qwen3moe":
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in shapes]
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=experts,
            num_experts_per_tok=used,
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=bool(fields.get("qwen3moe.expert_weights_norm", True)),
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            architectures=["Qwen3MoeForCausalLM"],
        )
    return transformers.MixtralConfig(
        **common, num_local_experts=experts, num_experts_per_tok=used, architectures=["MixtralForCausalLM"]
    )
