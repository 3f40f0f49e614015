"""A byte-level BPE tokenizer from a GGUF file's metadata (for ``--tokenizer model.gguf``), without gguf or torch.

A GGUF file carries no tokenizer.json: the vocabulary, merges, token types and
special token ids are metadata under llama.cpp's key names. Only byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Qwen2, Llama 3, ...) are
rebuilt here, the way transformers rebuilds them, as the files of a tokenizer
directory. Other kinds (SentencePiece) need the worker's files.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from typing import BinaryIO

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one scalar (little-endian).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Arrays read in full; every other array is skipped.
_WANTED_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (others: GPT-2's, built into ByteLevel).
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _unpack(f: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF metadata")
    return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _unpack(f, "Q")
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep: bool):
    if kind == _STRING:
        return _string(f)
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind != _ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item_kind, count = _unpack(f, "I"), _unpack(f, "Q")
    if item_kind == _STRING:
        items = [_string(f) for _ in range(count)]
        return items if keep else None
    if item_kind not in _SCALARS:
        raise ValueError(f"unsupported GGUF array item type {item_kind}")
    fmt = _SCALARS[item_kind]
    if not keep:
        f.seek(count * struct.calcsize(fmt), 1)
        return None
    items = array.array({"?": "B"}.get(fmt, fmt))
    items.frombytes(f.read(count * items.itemsize))
    if sys.byteorder == "big":
        items.byteswap()
    return items.tolist()


def read_gguf_metadata(path: str) -> dict[str, object]:
    """The key/value metadata of a GGUF (v2/v3) file; large arrays other than the tokenizer's are skipped."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file")
        version = _unpack(f, "I")
        if version < 2:
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (2 or later)")
        _unpack(f, "Q")  # tensor count
        metadata = {}
        for _ in range(_unpack(f, "Q")):
            key = _string(f)
            kind = _unpack(f, "I")
            value = _value(f, kind, keep=key in _WANTED_ARRAYS)
            if value is not None:
                metadata[key] = value
        return metadata


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes that are printable keep their own character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def gguf_tokenizer_files(metadata: dict[str, object]) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json for a byte-level BPE vocabulary described by GGUF metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"the GGUF tokenizer is of kind {kind!r}; only byte-level BPE ('gpt2') can be read here. "
            "Leave --tokenizer empty to use the worker's tokenizer files, or pass a tokenizer directory"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:  # stored as raw text: respell its bytes in the byte alphabet
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(str(metadata.get("tokenizer.ggml.pre")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens are special (skipped when decoding); user-defined ones are matched whole but kept.
    # A control token outside the byte alphabet is a mislabel in the file and would grow the vocabulary.
    control = [
        t for t, kind in zip(tokens, token_types, strict=False) if kind == TOKEN_TYPE_CONTROL and set(t) <= spelled
    ]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, kind in zip(tokens, token_types, strict=False) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    config: dict[str, object] = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            config[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    # No post-processor: TextTokenizer builds one from add_bos_token/add_eos_token, as transformers does here.
    spec = json.loads(backend.to_str())
    spec["post_processor"] = None
    return {"tokenizer.json": json.dumps(spec).encode(), "tokenizer_config.json": json.dumps(config).encode()}


def read_gguf_tokenizer(path: str) -> dict[str, bytes]:
    """Tokenizer files (as a tokenizer directory would hold them) for a GGUF model file."""
    return gguf_tokenizer_files(read_gguf_metadata(path))
