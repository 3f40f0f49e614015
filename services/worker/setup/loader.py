"""Reading a model: a Hugging Face directory (config.json + safetensors) or a GGUF file.

Formats are read by the libraries that own them (``safetensors``, ``transformers``' GGUF
reader, which dequantizes and un-permutes to Hugging Face tensor names); the model itself
is kvgrid's own. Every failure becomes a ``ModelLoadError`` with a one-line reason.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.layers.rope import RopeError, inverse_frequencies
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM
from services.worker.models.registry import ARCHITECTURES, FAMILIES, family_of
from services.worker.parallel.sharding import shard_weights
from services.worker.parallel.stages import stage_weights
from services.worker.quant.gguf_weights import read_gguf
from services.worker.quant.load import quantize_loaded, quantized_weights
from services.worker.setup.gguf_config import OWN_MODEL_TYPES, gguf_fields, hf_config_from_gguf, reads_itself

log = logging.getLogger(__name__)

# Tokens that end a chat turn in the templates of common models; included in the EOS ids when present.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>")
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


class ModelLoadError(Exception):
    """The model cannot be loaded; the message is one line for the operator."""


@dataclass(slots=True)
class ModelSource:
    path: str  # HF directory or GGUF file
    format: str  # "safetensors" or "gguf"

    @property
    def hf_kwargs(self) -> tuple[str, dict]:
        """(directory, extra kwargs) for transformers' from_pretrained."""
        if self.format == "gguf":
            return os.path.dirname(os.path.abspath(self.path)), {"gguf_file": os.path.basename(self.path)}
        return self.path, {}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def resolve_source(path: str, load_format: str = "auto") -> ModelSource:
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if load_format == "safetensors" or not (load_format == "gguf" or path.lower().endswith(".gguf")):
            raise ModelLoadError(f"{path!r} is a file but not a .gguf file; pass a GGUF file or a HF model directory")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"{path!r} is not a GGUF file (bad magic bytes)")
        return ModelSource(path, "gguf")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path!r} has no config.json; pass a HF model directory or a GGUF file")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ModelLoadError(f"{path!r} has no *.safetensors weights")
    return ModelSource(path, "safetensors")


def read_config(source: ModelSource) -> tuple[Any, LlamaArgs]:
    """The transformers config and kvgrid's model arguments; rejects unsupported architectures."""
    from transformers import AutoConfig

    directory, kwargs = source.hf_kwargs
    try:
        hf_config = _own_gguf_config(source) or AutoConfig.from_pretrained(directory, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model config of {source.path!r}: {_one_line(exc)}") from exc
    model_type = getattr(hf_config, "model_type", "")
    archs = getattr(hf_config, "architectures", None) or []
    family = family_of(model_type, archs[0] if archs else None)
    if family is None:
        name = archs[0] if archs else model_type
        raise ModelLoadError(f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    try:
        family.check(hf_config)
        args = family.read_args(hf_config)
        inverse_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    except (RopeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{source.path!r}: {_one_line(exc)}") from exc
    return hf_config, args


def _own_gguf_config(source: ModelSource) -> Any | None:
    """The config of a GGUF file whose architecture transformers' GGUF reader does not (fully) describe."""
    if source.format != "gguf":
        return None
    fields, shapes = gguf_fields(source.path)
    return hf_config_from_gguf(fields, shapes) if reads_itself(fields) else None


def iter_weights(source: ModelSource, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs."""
    if source.format == "safetensors":
        from safetensors import safe_open

        for file in sorted(glob.glob(os.path.join(source.path, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        return
    if hf_config.model_type in OWN_MODEL_TYPES:
        args = LlamaArgs.from_hf_config(hf_config)
        yield from read_gguf(source.path, args.num_heads, args.num_kv_heads, dequantize=True)
        return
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The GGUF reader maps tensor names through a model skeleton; on the meta device it costs nothing.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=skeleton)
    yield from parsed["tensors"].items()


def build_model(
    source: ModelSource,
    hf_config: Any,
    args: LlamaArgs,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device,
    quantization: str = "none",
    shard: tuple[int, int] = (0, 1),
    layers: tuple[int, int] | None = None,
) -> LlamaForCausalLM:
    """``args`` are the shapes to build; with ``shard`` (rank, size) of size > 1, those of one tensor-parallel rank;
    with ``layers`` [start, end), those of one pipeline stage (``args.num_layers`` is already the stage's)."""
    family = FAMILIES[hf_config.model_type]
    with torch.device("meta"):
        model = family.model(args, backend).to(dtype)
    model.to_empty(device=device)
    try:
        with torch.no_grad():
            weights = quantized_weights(source, args, quantization) or iter_weights(source, hf_config)
            weights = family.rename(weights, args)
            if layers is not None:
                weights = stage_weights(weights, layers)
            model.load_weights(shard_weights(weights, *shard) if shard[1] > 1 else weights)
            quantize_loaded(model, quantization)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the weights of {source.path!r}: {_one_line(exc)}") from exc
    model.init_rope()
    return model.eval().requires_grad_(False)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    directory, kwargs = source.hf_kwargs
    try:
        return AutoTokenizer.from_pretrained(directory, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the tokenizer of {source.path!r}: {_one_line(exc)}") from exc


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes, as bytes: the frontend rebuilds the tokenizer from them."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        out = {}
        for name in sorted(os.listdir(tmp)):
            full = os.path.join(tmp, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    out[name] = f.read()
        return out


def eos_token_ids(source: ModelSource, hf_config: Any, tokenizer) -> list[int]:
    """EOS ids of the config, generation config and tokenizer, plus the tokens that end a chat turn."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    if source.format == "safetensors" and os.path.isfile(os.path.join(source.path, "generation_config.json")):
        from transformers import GenerationConfig

        try:
            add(GenerationConfig.from_pretrained(source.path).eos_token_id)
        except Exception as exc:  # noqa: BLE001 - a bad generation config only loses its EOS ids
            log.warning("ignoring generation_config.json: %s", _one_line(exc))
    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in vocab:
            add(vocab[token])
    return ids
