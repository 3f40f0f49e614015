"""Tiny random Hugging Face models written to a directory, and helpers to drive the runner directly."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvgrid.v1 import common_pb2  # noqa: E402
from services.worker.request_state import RequestState  # noqa: E402
from services.worker.sampling.request_sampling import RequestSampling  # noqa: E402

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# Per kind, beside BASE: Gemma 3's five sliding-window layers then a global one, shrunk to 3 layers and a window of 8
# (prompts in the tests run past it), with a local rotary base unlike the global one.
EXTRA = {
    "gemma3": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # experts in layer 1 only (layer 0 dense), top-2 of 6 not renormalized
    "qwen3_moe": dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0]
    ),
}


def save_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A random ``kind`` (see KINDS) causal LM saved as safetensors in ``path``."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in KINDS[kind])
    config = config_cls(**{**BASE, **EXTRA.get(kind, {}), **overrides})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: str, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy() -> RequestSampling:
    return RequestSampling.create(common_pb2.SamplingParams(), [], [])


def request(rid: str, token_ids: list[int], block_ids: list[int], computed: int, scheduled: int) -> RequestState:
    return RequestState(
        request_id=rid,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        block_ids=list(block_ids),
        num_computed_tokens=computed,
        sampling=greedy(),
        num_scheduled_tokens=scheduled,
    )


def run_logits(runner, requests: list[RequestState]) -> dict[str, torch.Tensor]:
    """Forward one step and commit the computed counts; logits of the sampling rows by request id."""
    inputs = runner.prepare(requests)
    logits = runner.compute_logits(inputs)
    for r in requests:
        r.num_computed_tokens += r.num_scheduled_tokens
        r.num_scheduled_tokens = 0
    return {r.request_id: logits[i] for i, r in enumerate(inputs.sampling_requests)}


def drop_packed_gemms(model) -> None:
    """The model's matmuls back on the kernels they take without weights packed at load (set_packed_gemms)."""
    for m in model.modules():
        if getattr(m, "gemm", None) is not None:
            m.gemm = None
    model.logits_gemm = None
    if model.native_path is not None:
        model.native_path.forget_plans()


def save_tiny_tokenizer(path: str, vocab_size: int = 150) -> str:
    """A word-level tokenizer ("t0 t1 ..." -> ids) with <|im_end|> as EOS, id ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<|im_end|>"] = vocab_size
    vocab["<unk>"] = vocab_size + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def tiny_bytelevel_tokenizer():
    """A byte-level BPE tokenizer (256 byte tokens, a few merges, <|im_end|>): any text encodes, and
    llguidance can read it (it needs a byte-level or SentencePiece decoder)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for a, b in [("t", "r"), ("tr", "u"), ("tru", "e"), ("Ġ", "t"), ('"', ":"), ("n", "o")]:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    return tok


def save_tiny_bytelevel_tokenizer(path: str) -> str:
    """``tiny_bytelevel_tokenizer`` saved as a fast tokenizer (263 ids: pair it with a model of vocab >= 263)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tiny_bytelevel_tokenizer(), eos_token="<|im_end|>")
    fast.save_pretrained(path)
    return path
