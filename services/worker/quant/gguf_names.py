"""llama.cpp's GGUF tensor names as the Hugging Face names kvgrid's models load, per GGUF architecture.

``blk.N.<part>`` is a layer's tensor; the part names are gguf's ``TENSOR_NAMES``. Where llama.cpp's converter
keeps a tensor fused, the name is the checkpoint's fused one and the family's rename splits it (Phi-3's
``attn_qkv`` and gate-then-up ``ffn_up``). Mixtures of experts (Mixtral, written as architecture ``llama`` with
``expert_count``; ``qwen3moe``) store each projection of all experts as one 3-D tensor ``ffn_*_exps`` [E, N, K]:
``expert_names`` gives the names of its E slices.
"""

from __future__ import annotations

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # the router of a mixture of experts
}
_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_ARCH_LAYER_NAMES = {
    # Gemma 3 norms around both blocks: llama.cpp's ffn_norm is its pre-feedforward norm there
    "gemma3": _LAYER_NAMES
    | {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's converter permutes the rows of q and k for its rotary layout in these architectures only
# (LlamaModel.permute; Mixtral is written as "llama"); the others keep Hugging Face's row order
PERMUTED_ARCHS = frozenset({"llama"})


def hf_name(name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for tensors kvgrid skips
    (expert stacks: ``expert_names``)."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    return None  # e.g. rope_freqs: kvgrid computes rotary tables itself


def expert_names(name: str, num_experts: int) -> list[str] | None:
    """'blk.1.ffn_gate_exps.weight' -> the names of experts 0..E-1's gate_proj in layer 1; None for other tensors."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in _EXPERT_PARTS:
        return None
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{_EXPERT_PARTS[parts[2]]}.{kind}" for e in range(num_experts)]


def is_expert_stack(name: str) -> bool:
    return expert_names(name, 0) is not None
