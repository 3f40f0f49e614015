"""``--speculative-config``: vLLM's JSON for speculative decoding, parsed into one plain record.

Two methods: ``ngram`` (prompt lookup: the worker proposes the tokens that followed the latest earlier
occurrence of the request's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
and ``draft_model`` (a smaller model with the same tokenizer; ``model`` is its path). Both propose up to
``num_speculative_tokens`` tokens per decode step, which the target verifies in one forward pass.
``disable_by_batch_size``: a step with more running requests than this proposes nothing (0: no limit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
    "quantization",
}
# The draft model's weights (vLLM's key): as --quantization takes them; absent means the target's setting.
DRAFT_QUANTIZATIONS = ("none", "int8", "gguf")
# vLLM accepts "[ngram]" as the model of an ngram config.
_NGRAM_MODEL = "[ngram]"
DEFAULT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    model: str = ""
    disable_by_batch_size: int = 0
    quantization: str = ""  # the draft model's (draft_model only); "" takes --quantization


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The JSON text of ``--speculative-config`` -> a config, None when empty; raises ValueError naming the key."""
    if not text or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(raw, dict):
        raise ValueError('must be a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    method = raw.get("method")
    if method is None and raw.get("model") == _NGRAM_MODEL:
        method = "ngram"
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    ints = {}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        if value is not None:
            ints[key] = value
    k = ints.get("num_speculative_tokens")
    if not k:
        raise ValueError("num_speculative_tokens must be given and >= 1")
    model = raw.get("model") or ""
    if not isinstance(model, str):
        raise ValueError(f"model must be a path, got {model!r}")
    if method == "ngram":
        if raw.get("quantization"):
            raise ValueError("quantization applies to method draft_model (the draft model's weights)")
        lo = ints.get("prompt_lookup_min")
        hi = ints.get("prompt_lookup_max")
        # As vLLM: either bound alone sets both; neither means 5.
        lo = lo if lo is not None else (hi if hi is not None else DEFAULT_LOOKUP)
        hi = hi if hi is not None else lo
        if not 1 <= lo <= hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be >= 1 and <= prompt_lookup_max ({hi})")
        return SpeculativeConfig("ngram", k, lo, hi, "", ints.get("disable_by_batch_size", 0))
    if not model:
        raise ValueError("method draft_model needs model (the draft model's path)")
    quantization = raw.get("quantization") or ""
    if quantization and quantization not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)}, got {quantization!r}")
    return SpeculativeConfig(
        "draft_model",
        k,
        model=model,
        disable_by_batch_size=ints.get("disable_by_batch_size", 0),
        quantization=quantization,
    )
