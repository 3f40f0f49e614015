"""A GGUF model converted once into a Hugging Face directory, so that later starts skip the GGUF reader.

transformers' GGUF reader parses the whole file's metadata (for SmolLM2, ~440k
fields of tokenizer vocabulary) in Python each time the config, the tokenizer or
the weights are read: three passes, which dominate a small model's start. The first
start writes what they produce (config.json, the tokenizer's files, the
dequantized weights as safetensors) under ``$KVGRID_CACHE_DIR/models``, keyed by
the GGUF file's path, size and modification time; later starts read that
directory like any HF model. A cache that cannot be written only costs the time.
Dequantized weights take 4-8x the GGUF's bytes, so files over MAX_CONVERT_BYTES
are read directly every time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from services.worker.setup.cache_dir import cache_root, match_dir_modes, new_sibling_dir
from services.worker.setup.loader import ModelLoadError, ModelSource, iter_weights, load_tokenizer, read_config

log = logging.getLogger(__name__)

# Bump when what is written changes: older entries are then ignored.
FORMAT_VERSION = 1
DONE_MARKER = "kvgrid-converted"
MAX_CONVERT_BYTES = 2 * 2**30


def converted_dir(source: ModelSource, root: Path | None = None) -> Path:
    stat = os.stat(source.path)
    identity = f"{FORMAT_VERSION}:{os.path.abspath(source.path)}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = Path(source.path).name.removesuffix(".gguf")
    return (root or cache_root() / "models") / f"{name}-{digest}"


def cached_source(source: ModelSource, root: Path | None = None) -> ModelSource:
    """The converted directory of a GGUF source, converting it first if needed; other sources as they are."""
    if source.format != "gguf":
        return source
    if os.path.getsize(source.path) > MAX_CONVERT_BYTES:
        log.info("%s is over %d GiB: read directly, not converted into a cache", source.path, MAX_CONVERT_BYTES >> 30)
        return source
    target = converted_dir(source, root)
    if (target / DONE_MARKER).is_file():
        return ModelSource(str(target), "safetensors")
    started = time.perf_counter()
    try:
        convert(source, target)
    except OSError as exc:
        log.warning("cannot cache the converted model in %s (%s); reading the GGUF file directly", target, exc)
        return source
    log.info("converted %s once into %s in %.1fs", source.path, target, time.perf_counter() - started)
    return ModelSource(str(target), "safetensors")


def convert(source: ModelSource, target: Path) -> None:
    """Write the HF directory into a temporary sibling, then rename it into place (atomic for readers).

    The entry gets the umask's modes, not private ones, so a cache written at image build time (as
    root) is readable by the user the image runs as.
    """
    from safetensors.torch import save_file

    hf_config, _ = read_config(source)
    tokenizer = load_tokenizer(source)
    try:
        tensors = {name: tensor.contiguous() for name, tensor in iter_weights(source, hf_config)}
    except Exception as exc:
        raise ModelLoadError(f"cannot load the weights of {source.path!r}: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_sibling_dir(target.parent, prefix=f".{target.name}-")
    try:
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / DONE_MARKER).write_text(f"{source.path}\n")
        match_dir_modes(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / DONE_MARKER).is_file():  # not a concurrent worker that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
