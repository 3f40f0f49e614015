"""The converted-GGUF cache: keyed by the file's identity, reused when complete, skipped when unwritable."""

from __future__ import annotations

import os

from services.worker.setup import gguf_cache
from services.worker.setup.loader import ModelSource


def fake_convert(calls):
    def convert(source, target):
        calls.append(target)
        target.mkdir(parents=True)
        (target / gguf_cache.DONE_MARKER).write_text("")

    return convert


def test_a_gguf_is_converted_once_and_a_changed_file_is_converted_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_cache, "convert", fake_convert(calls))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    root = tmp_path / "cache"
    first = gguf_cache.cached_source(ModelSource(str(gguf), "gguf"), root)
    again = gguf_cache.cached_source(ModelSource(str(gguf), "gguf"), root)
    assert first == again == ModelSource(str(calls[0]), "safetensors") and len(calls) == 1
    assert calls[0].parent == root and calls[0].name.startswith("m-")
    os.utime(gguf, ns=(1, 1))  # a replaced file: another entry
    gguf_cache.cached_source(ModelSource(str(gguf), "gguf"), root)
    assert len(calls) == 2 and calls[1] != calls[0]


def test_safetensors_sources_pass_and_an_unwritable_cache_falls_back_to_the_gguf(tmp_path, monkeypatch):
    hf = ModelSource(str(tmp_path), "safetensors")
    assert gguf_cache.cached_source(hf, tmp_path / "cache") is hf

    def fail(source, target):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(gguf_cache, "convert", fail)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = ModelSource(str(gguf), "gguf")
    assert gguf_cache.cached_source(source, tmp_path / "cache") is source


def test_a_gguf_over_the_size_limit_is_read_directly(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_cache, "convert", fake_convert(calls))
    monkeypatch.setattr(gguf_cache, "MAX_CONVERT_BYTES", 8)
    gguf = tmp_path / "big.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    source = ModelSource(str(gguf), "gguf")
    assert gguf_cache.cached_source(source, tmp_path / "cache") is source and calls == []
