"""GGUF files of the architectures beyond Llama and Gemma, written from tiny random Hugging Face models the way
llama.cpp's converter writes them (``tiny_gguf``): Qwen3 (q/k norms), Phi-3 (fused ``attn_qkv`` and gate/up
``ffn_up``), Mixtral (architecture ``llama`` with experts, q/k rows permuted) and Qwen3-MoE (``qwen3moe``).

- The config kvgrid reads from the GGUF metadata gives the model the checkpoint's own config gives.
- float32 GGUF (dequantized): greedy tokens equal transformers' on the Hugging Face model, token for token;
  also served by the real worker and scheduler over gRPC, chunked prefills and preempted requests included.
- ``--quantization gguf``: Q8_0 and Q4_K matrices stay packed (Phi-3's fused ones split by rows, Mixtral's
  permuted q/k rows reordered; experts dequantized) and, under teacher forcing, each step's choice is within
  the float32 model's top 5 (the same file dequantized), the top 1 agreeing at least 90% of the time.
- A Phi-3 GGUF with long-context rope factors is refused with a one-line reason.
"""

from __future__ import annotations

import asyncio

import gguf
import pytest
import torch

from services.worker.core import build_core
from services.worker.layers.linear import Linear
from services.worker.models.registry import FAMILIES
from services.worker.setup.build import load_model
from services.worker.setup.gguf_config import gguf_fields, hf_config_from_gguf
from services.worker.setup.loader import ModelLoadError
from tests.worker.test_architectures import _requests, _serve, _worker_config
from tests.worker.test_kquant_model import PROMPTS, packed_formats, step_logits, teacher_forced_agreement
from tests.worker.tiny import hf_model, save_tiny_model
from tests.worker.tiny_gguf import VOCAB, write_gguf

pytestmark = pytest.mark.timeout(300)

# llama.cpp's qwen3moe has experts in every layer, top-k weights rescaled to sum to 1
OVERRIDES = {"qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True)}
KINDS = ("qwen3", "phi3", "mixtral", "qwen3_moe")  # the GGUF architectures kvgrid reads itself
LLAMA_KINDS = ("llama", "mistral", "qwen2")  # read through transformers' GGUF reader
GREEDY_PROMPTS = [[5, 17, 99, 200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [250, 7]]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGRID_CACHE_DIR", str(tmp_path / "cache"))  # the converted GGUFs stay in the test's tmp


def tiny(tmp_path, kind: str, choose=lambda name: None, **overrides) -> tuple[str, str, dict[str, str]]:
    """(Hugging Face directory, GGUF path, quantized tensors' formats) of a tiny ``kind`` model."""
    model_dir = str(tmp_path / kind)
    save_tiny_model(model_dir, kind, seed=3, vocab_size=VOCAB, **{**OVERRIDES.get(kind, {}), **overrides})
    path = str(tmp_path / f"{kind}.gguf")
    return model_dir, path, write_gguf(model_dir, path, choose)


@pytest.mark.parametrize("kind", KINDS)
def test_config_from_gguf_metadata(tmp_path, kind):
    model_dir, path, _ = tiny(tmp_path, kind)
    ours = hf_config_from_gguf(*gguf_fields(path))
    theirs = hf_model(model_dir).config
    assert ours.model_type == theirs.model_type and ours.architectures == theirs.architectures
    family = FAMILIES[theirs.model_type]
    assert family.read_args(ours) == family.read_args(theirs)


@pytest.mark.parametrize("kind", LLAMA_KINDS + KINDS)
def test_float_gguf_greedy_equals_transformers(tmp_path, kind):
    model_dir, path, _ = tiny(tmp_path, kind)
    loaded = load_model(path, dtype="float32", device="cpu")
    # Mistral's GGUF is a "llama" one: the same layers (a sliding window would not be recorded)
    expected = "LlamaForCausalLM" if kind == "mistral" else hf_model(model_dir).config.architectures[0]
    assert loaded.args.architecture == expected
    steps = step_logits(loaded, GREEDY_PROMPTS)
    hf = hf_model(model_dir)
    for prompt, logits in zip(GREEDY_PROMPTS, steps, strict=True):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(logits), do_sample=False, eos_token_id=None)
        assert logits.argmax(dim=-1).tolist() == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_served_equals_transformers(tmp_path, kind):
    model_dir, path, _ = tiny(tmp_path, kind)
    core = build_core(_worker_config(path, kind))
    hf = hf_model(model_dir)
    assert core.handshake.architecture == hf.config.architectures[0]
    requests = _requests()
    tokens, preemptions = asyncio.run(_serve(path, kind, core, requests))
    assert preemptions > 0
    for r in requests:
        prompt = list(r.prompt_token_ids)
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=r.sampling.max_tokens, do_sample=False, eos_token_id=None
            )
        assert tokens[r.request_id] == out[0, len(prompt) :].tolist(), r.request_id


def q4_k_down_q8_0_rest(name: str) -> str:
    """The dense down projections (K = 256, whole K-quant super-blocks) to Q4_K, every other matrix to Q8_0."""
    return "q4_k" if name.endswith(".ffn_down.weight") else "q8_0"


# experts (3-D stacks) are dequantized: in Mixtral and Qwen3-MoE only attention, router and embeddings stay packed
PACKED = {"phi3": {"q8_0", "q4_k"}, "qwen3": {"q8_0", "q4_k"}, "qwen2": {"q8_0", "q4_k"}}


@pytest.mark.parametrize("kind", ["phi3", "qwen3", "qwen2", "mixtral", "qwen3_moe"])
def test_packed_gguf_stays_in_float_top5(tmp_path, kind):
    """Q8_0 / Q4_K blocks kept packed: Phi-3's fused attn_qkv and ffn_up split by rows, Mixtral's q and k rows
    un-permuted."""
    _, path, chosen = tiny(tmp_path, kind, q4_k_down_q8_0_rest, intermediate_size=256)
    assert "blk.0.attn_q.weight" in chosen or "blk.0.attn_qkv.weight" in chosen
    quantized = load_model(path, dtype="float32", device="cpu", quantization="gguf")
    dense = load_model(path, dtype="float32", device="cpu")
    assert packed_formats(quantized) == PACKED.get(kind, {"q8_0"})
    attention = [m for name, m in quantized.model.named_modules() if isinstance(m, Linear) and ".self_attn." in name]
    assert attention and all(m.packed is not None for m in attention)
    assert teacher_forced_agreement(quantized, dense, PROMPTS) >= 0.9


def test_phi3_long_rope_gguf_is_refused(tmp_path):
    _, path, _ = tiny(tmp_path, "phi3")
    reader = gguf.GGUFReader(path)
    copy = str(tmp_path / "phi3-longrope.gguf")
    writer = gguf.GGUFWriter(copy, "phi3")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    half = reader.fields["phi3.rope.dimension_count"].contents() // 2
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        writer.add_tensor(name, torch.ones(half).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="longrope") as error:
        load_model(copy, dtype="float32", device="cpu")
    assert "\n" not in str(error.value)
