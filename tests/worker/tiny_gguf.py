"""A tiny Hugging Face model written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes it.

Names come from gguf's own ``TensorNameMap`` (the table the converter maps through), so they do not repeat
kvgrid's reverse map. As the converter does: Llama, Mistral and Mixtral are architecture ``llama`` (Mixtral with
``expert_count``), their q/k rows permuted (``LlamaModel.permute``); experts of one projection are stacked into
one [E, N, K] tensor (``ffn_gate_exps`` ...); Phi-3's ``qkv_proj`` and ``gate_up_proj`` stay fused (``attn_qkv``,
``ffn_up``); the metadata keys are those its ``set_gguf_parameters`` writes for each architecture. The tokenizer
is the tiny byte-level BPE (``tiny.tiny_bytelevel_tokenizer``) as a ``gpt2`` vocabulary."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable

import gguf
import torch

from tests.worker.kquant_pack import GGML_NAMES, quantize
from tests.worker.tiny import tiny_bytelevel_tokenizer

ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
}
VOCAB = 263  # tiny_bytelevel_tokenizer's ids: the models written here have this vocabulary
_EXPERT = re.compile(r"(.*layers\.(\d+)\.)(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order for q/k of a ``llama`` model (pairs (i, i + D/2) made adjacent per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model_dir: str, cfg: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, experts stacked per layer and projection as the converter stacks them."""
    from safetensors.torch import load_file

    flat: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        flat |= load_file(file)
    out, experts = {}, {}
    for name, tensor in flat.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        experts.setdefault((m.group(1), m.group(3), m.group(5)), {})[int(m.group(4))] = tensor
    for (prefix, block, part), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        # the converter's merged names: Mixtral's layers.N.feed_forward.experts.w1, Qwen's mlp.experts.gate_proj
        name = f"layers.{prefix.split('.')[-2]}.feed_forward.experts.{part}" if block == "block_sparse_moe" else None
        out[(name or f"{prefix}mlp.experts.{part}") + ".weight"] = stacked
    if ARCHS[cfg["model_type"]] == "llama":
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for name in out:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                out[name] = _permute(out[name], heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                out[name] = _permute(out[name], kv_heads)
    return out


def _metadata(writer: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "phi3" and cfg.get("head_dim") is not None:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        )
        writer.add_rope_dimension_count(hidden // heads)
        writer.add_sliding_window(cfg.get("sliding_window") or 0)


def _vocabulary(writer: gguf.GGUFWriter) -> None:
    tok = json.loads(tiny_bytelevel_tokenizer().to_str())
    vocab = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    assert len(tokens) == VOCAB
    special = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_bos_token_id(vocab["<|im_end|>"])


def write_gguf(model_dir: str, path: str, choose: Callable[[str], str | None] = lambda name: None) -> dict[str, str]:
    """``model_dir``'s tiny model (vocabulary VOCAB) as a GGUF file at ``path``: float32 tensors, or the matrices
    ``choose(gguf name)`` names quantized (a K-quant of ``kquant_pack`` or a type gguf quantizes: q8_0, q4_0).
    Returns the quantized tensors' formats by name."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCHS[cfg["model_type"]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, cfg, arch)
    _vocabulary(writer)
    chosen = {}
    for hf, tensor in sorted(_tensors(model_dir, cfg).items()):
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf}"
        dense = tensor.float().numpy()
        fmt = choose(name) if dense.ndim >= 2 else None
        if fmt is None:
            writer.add_tensor(name, dense)
            continue
        if fmt in GGML_NAMES:
            data, kind = quantize(dense, fmt), gguf.GGMLQuantizationType[GGML_NAMES[fmt]]
        else:
            kind = gguf.GGMLQuantizationType[fmt.upper()]
            data = gguf.quants.quantize(dense, kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        chosen[name] = fmt
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen
