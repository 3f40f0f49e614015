"""Builds the native CPU kernels once per source version, and loads them with ctypes.

Three shared libraries, each from its C file (plus the headers beside it: ``scalar.h``, ``kquants.h``...):
- ``decode_kernels.c``: the float32/bfloat16 step kernels, compiled for AVX2 and FMA (paged
  attention also with AVX-512 and AVX512-BF16, chosen at run time: ``ATTENTION_PATHS``, and the
  bfloat16 GEMV with AVX512-BF16: ``LINEAR_PATHS``, and the bfloat16 tile GEMM on AMX tiles or AVX512-BF16:
  ``TILE_PATHS``); ``load`` raises
  ``NativeKernelsUnavailable`` on CPUs without AVX2 and FMA.
- ``prefill_attention.c``: causal attention of prefill chunks over the paged cache, compiled for
  AVX-512F; ``load_prefill`` raises ``NativeKernelsUnavailable`` on CPUs without it (prefill chunks
  keep torch's SDPA there).
- ``quant_kernels.c``: the quantized linear (``--quantization``), compiled for any x86-64 or
  other CPU, with AVX-512 VNNI and AVX2 inner loops chosen at run time (per-function target
  attributes); ``load_quant``, ``QUANT_PATHS``. Batches of rows on packed weights that keep a bfloat16
  copy take the AMX tile GEMM of ``decode_kernels.c`` (``quant/matmul.py``).

A library lands in ``$KVGRID_CACHE_DIR/native`` (default ``~/.cache/kvgrid/native``), named by a
hash of its sources and flags; later starts load it without compiling. Building needs a C
compiler (``$CC``, else ``cc``). Both link OpenMP by soname, so once torch is imported they share
torch's runtime; callers pass ``torch.get_num_threads()`` through ``*_set_num_threads`` before
each step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from ctypes import c_float, c_int, c_int64, c_void_p
from dataclasses import dataclass
from pathlib import Path

from services.worker.cpu_kernels import decode_step
from services.worker.setup.cache_dir import cache_root
from services.worker.setup.cpu_features import cpu_flags

HERE = Path(__file__).parent
SOURCE = HERE / "decode_kernels.c"
COMMON = ("-O3", "-std=gnu11", "-fopenmp", "-shared", "-fPIC")
FLAGS = (*COMMON, "-mavx2", "-mfma")
DTYPE_CODES = {"float32": 0, "bfloat16": 1}  # see scalar.h
# Paged decode attention's vector widths, slowest first (kvg_select_attention_path's codes, decode_kernels.c).
ATTENTION_PATHS = ("avx2", "avx512", "avx512-bf16")
# The bfloat16 GEMV's paths, slowest first (kvg_select_linear_path's codes): widened to float32, or bfloat16 pairs.
LINEAR_PATHS = ("avx2", "avx512-bf16")
# Kernels of the bfloat16 tile GEMM (tile_gemm.py), by kvg_tile_path's number: none on this CPU, AMX tiles
# (amx_gemm.h), or the same layout on AVX512-BF16 dot products (tile_gemm_bf16dot.h).
TILE_PATHS = (None, "amx", "avx512-bf16")
# Prefill attention's paths for bfloat16 caches (kvp_select_path's codes, prefill_attention.c).
PREFILL_PATHS = ("float32", "amx", "avx512-bf16")
# The quantized linear's dot products, slowest first (kvq_select_path's codes, see quant_kernels.c).
QUANT_PATHS = ("scalar", "avx2", "avx512-vnni")

_SIGNATURES = {
    "kvg_set_num_threads": (c_int,),
    # x, w, bias, y, ldy, M, N, K, dtype, accumulate
    "kvg_linear": (c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int64, c_int64, c_int, c_int),
    # x, w, out, M, E, eps, dtype
    "kvg_rms_norm": (c_void_p, c_void_p, c_void_p, c_int, c_int64, c_float, c_int),
    "kvg_rms_norm_scaled": (c_void_p, c_void_p, c_void_p, c_int, c_int64, c_float, c_int),  # scale: float32
    # gate_up, out, M, I, dtype
    "kvg_silu_mul": (c_void_p, c_void_p, c_int, c_int64, c_int),
    "kvg_gelu_tanh_mul": (c_void_p, c_void_p, c_int, c_int64, c_int),
    "kvg_add": (c_void_p, c_void_p, c_int64, c_int),
    # qkv, ldq, cos, sin, positions, slots, k_cache, v_cache, M, H, KV, D, dtype
    "kvg_rope_write_kv": (
        (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p) + (c_int,) * 5
    ),
    # q, ldq, k_cache, v_cache, block_tables, ldt, seq_lens, out, ldo, B, H, KV, D, block_size, scale, dtype, window
    "kvg_decode_attention": (
        (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int64)
        + (c_int,) * 5
        + (c_float, c_int, c_int)
    ),
    # x, ldx, w (tiles), bias, y, ldy, M, N, K, accumulate -> 1, or 0 where no tile kernel runs (tile_gemm_bf16dot.h)
    "kvg_tile_linear": (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int64, c_int64, c_int),
    "kvg_tile_path": (),  # -> the tile kernel in use (index of TILE_PATHS)
    "kvg_select_tile_path": (c_int,),  # the one asked for where it runs, else the best -> the one in use
    # x, ldx, M, N, out (int64), dtype
    "kvg_argmax_rows": (c_void_p, c_int64, c_int, c_int64, c_void_p, c_int),
    # x, y, n (the attention's exp, for the tests)
    "kvg_exp": (c_void_p, c_void_p, c_int64),
    "kvg_exp16": (c_void_p, c_void_p, c_int64),  # -> 1, or 0 without AVX-512
    "kvg_decode_layers": decode_step.SIGNATURE,
}
_PREFILL_SIGNATURES = {
    "kvp_set_num_threads": (c_int,),
    "kvp_select_path": (c_int,),  # PREFILL_PATHS' index: that one where it runs, else the fastest -> the one taken
    # q, ldq, k_cache, v_cache, block_tables, ldt, seq_lens, query_start, out, ldo, B, H, KV, D, block_size, scale,
    # dtype
    "kvp_prefill_attention": (
        (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64)
        + (c_int,) * 5
        + (c_float, c_int)
    ),
}
_QUANT_SIGNATURES = {
    "kvq_set_num_threads": (c_int,),
    # x, w, scales, bias, y, ldy, M, N, K, format, dtype, accumulate
    "kvq_linear": ((c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int64, c_int64) + (c_int,) * 3),
    # w, scales, index, count, K, format, out
    "kvq_dequantize_rows": (c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int, c_void_p),
    # x, M, K, dtype, q, scale
    "kvq_quantize_rows_int8": (c_void_p, c_int, c_int64, c_int, c_void_p, c_void_p),
    # x, M, K, dtype, q, scale, q2, scale2
    "kvq_quantize_residual_int8": (c_void_p, c_int, c_int64, c_int, c_void_p, c_void_p, c_void_p, c_void_p),
    # x, w, scales, bias, y, N, K, format, dtype, accumulate, first tile, end tile, next (see kvg_decode_layers)
    "kvq_linear_tiles": (
        (c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int, c_int, c_int, c_int64, c_int64)
        + (c_void_p,)
    ),
    # acc, M, N, row_scale, col_scale, bias, y, ldy, dtype, accumulate
    "kvq_scale_int32": (c_void_p, c_int, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int),
}


@dataclass(frozen=True, slots=True)
class Library:
    source: Path
    flags: tuple[str, ...]
    signatures: dict


DECODE = Library(SOURCE, FLAGS, _SIGNATURES)
QUANT = Library(HERE / "quant_kernels.c", COMMON, _QUANT_SIGNATURES)
PREFILL = Library(HERE / "prefill_attention.c", (*FLAGS, "-mavx512f"), _PREFILL_SIGNATURES)


class NativeKernelsUnavailable(RuntimeError):
    """The kernels cannot be built or run here; the message says why."""


def cache_dir() -> Path:
    return cache_root() / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeKernelsUnavailable("no C compiler found (set CC, or install gcc)")
    return cc


def build(directory: Path | None = None, library: Library = DECODE) -> Path:
    """The path of the compiled library, compiling it first if these sources and flags have none yet."""
    sources = library.source.read_bytes() + b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    digest = hashlib.sha256(sources + " ".join(library.flags).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"kvgrid_{library.source.stem}_{digest}.so"
    if target.exists():
        return target
    cc = _compiler()
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        command = [cc, *library.flags, str(library.source), "-o", tmp, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            name = library.source.name
            raise NativeKernelsUnavailable(f"{cc} failed to build {name}: {result.stderr.strip()[-500:]}")
        # mkstemp made it 0600: readable by all, as the compiler would have left it, so that an image built as
        # root serves its prebuilt kernels to the unprivileged user it runs as.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)  # atomic: concurrent workers never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _open(library: Library) -> ctypes.CDLL:
    import torch  # noqa: F401  (loaded first, so the library binds to torch's OpenMP runtime)

    try:
        lib = ctypes.CDLL(str(build(library=library)))
    except OSError as exc:
        raise NativeKernelsUnavailable(f"could not build or load the native kernels: {exc}") from exc
    for name, argtypes in library.signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


@functools.cache
def load() -> ctypes.CDLL:
    """The decode kernels, ready to call; raises NativeKernelsUnavailable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeKernelsUnavailable(f"the native kernels are for x86-64, this is {platform.machine()}")
    missing = {"avx2", "fma"} - cpu_flags()
    if missing:
        raise NativeKernelsUnavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    lib = _open(DECODE)
    lib.kvg_select_attention_path.argtypes, lib.kvg_select_attention_path.restype = (c_int,), c_int
    lib.kvg_attention_path.argtypes, lib.kvg_attention_path.restype = (), c_int
    lib.kvg_select_attention_path(len(ATTENTION_PATHS) - 1)
    for name in (
        "kvg_select_linear_path",
        "kvg_linear_path",
        "kvg_tile_linear",
        "kvg_tile_path",
        "kvg_select_tile_path",
        "kvg_exp16",
    ):
        getattr(lib, name).restype = c_int
    lib.kvg_select_linear_path.argtypes = (c_int,)
    lib.kvg_select_linear_path(len(LINEAR_PATHS) - 1)
    return lib


def attention_path() -> str:
    """The paged attention path in use (of ATTENTION_PATHS)."""
    return ATTENTION_PATHS[load().kvg_attention_path()]


def select_attention_path(name: str) -> str:
    """Use paged decode attention's ``name`` path (of ATTENTION_PATHS), or the fastest below it this CPU
    has (tests force each one); returns the path now in use."""
    return ATTENTION_PATHS[load().kvg_select_attention_path(ATTENTION_PATHS.index(name))]


def linear_path() -> str:
    """The bfloat16 GEMV path in use (of LINEAR_PATHS)."""
    return LINEAR_PATHS[load().kvg_linear_path()]


def select_linear_path(name: str) -> str:
    """Use the bfloat16 GEMV's ``name`` path (of LINEAR_PATHS), or the fastest below it this CPU has;
    returns the path now in use."""
    return LINEAR_PATHS[load().kvg_select_linear_path(LINEAR_PATHS.index(name))]


def tile_path() -> str | None:
    """The bfloat16 tile GEMM's kernel in use (of TILE_PATHS; None: this CPU runs neither)."""
    return TILE_PATHS[load().kvg_tile_path()]


def select_tile_path(name: str) -> str | None:
    """Use the tile GEMM's ``name`` kernel ("amx" or "avx512-bf16") where this CPU runs it, else the best it runs;
    returns the kernel now in use."""
    return TILE_PATHS[load().kvg_select_tile_path(TILE_PATHS.index(name))]


@functools.cache
def load_prefill() -> ctypes.CDLL:
    """Prefill attention over the paged cache; raises NativeKernelsUnavailable on CPUs without AVX-512F."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeKernelsUnavailable(f"the native kernels are for x86-64, this is {platform.machine()}")
    if "avx512f" not in cpu_flags():
        raise NativeKernelsUnavailable("this CPU lacks avx512f")
    lib = _open(PREFILL)
    lib.kvp_prefill_attention.restype = lib.kvp_select_path.restype = c_int
    return lib


@functools.cache
def load_quant() -> ctypes.CDLL:
    """The quantized linear on the fastest path this CPU has; raises NativeKernelsUnavailable."""
    lib = _open(QUANT)
    lib.kvq_select_path.argtypes, lib.kvq_select_path.restype = (c_int,), c_int
    lib.kvq_select_path(len(QUANT_PATHS) - 1)
    lib.kvq_takes_tiles.argtypes, lib.kvq_takes_tiles.restype = (c_int,), c_int
    return lib


def select_quant_path(name: str) -> str:
    """Use the quantized linear's ``name`` path (of QUANT_PATHS), or the fastest below it this CPU
    has (tests force each one); returns the path now in use."""
    return QUANT_PATHS[load_quant().kvq_select_path(QUANT_PATHS.index(name))]
