"""Builds ``decode_kernels.c`` once per source version and CPU, and loads it with ctypes.

The shared library lands in ``$KVGRID_CACHE_DIR/native`` (default ``~/.cache/kvgrid/native``),
named by a hash of the source and flags; later starts load it without compiling. It needs a C
compiler (``$CC``, else ``cc``) and an x86-64 CPU with AVX2 and FMA: without them ``load`` raises
``NativeKernelsUnavailable`` with the reason, and the worker keeps its torch path.
It links OpenMP by soname, so once torch is imported it shares torch's runtime; callers pass
``torch.get_num_threads()`` through ``kvg_set_num_threads`` before each step.
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
from pathlib import Path

from ..cache_dir import cache_root

SOURCE = Path(__file__).with_name("decode_kernels.c")
FLAGS = ("-O3", "-std=gnu11", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
DTYPE_CODES = {"float32": 0, "bfloat16": 1}  # see decode_kernels.c

_SIGNATURES = {
    "kvg_set_num_threads": (c_int,),
    # x, w, bias, y, ldy, M, N, K, dtype, accumulate
    "kvg_linear": (c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int64, c_int64, c_int, c_int),
    # x, w, out, M, E, eps, dtype
    "kvg_rms_norm": (c_void_p, c_void_p, c_void_p, c_int, c_int64, c_float, c_int),
    # gate_up, out, M, I, dtype
    "kvg_silu_mul": (c_void_p, c_void_p, c_int, c_int64, c_int),
    # qkv, ldq, cos, sin, positions, slots, k_cache, v_cache, M, H, KV, D, dtype
    "kvg_rope_write_kv": (
        (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p) + (c_int,) * 5
    ),
    # q, ldq, k_cache, v_cache, block_tables, ldt, seq_lens, out, ldo, B, H, KV, D, block_size, scale, dtype
    "kvg_decode_attention": (
        (c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int64)
        + (c_int,) * 5
        + (c_float, c_int)
    ),
}


class NativeKernelsUnavailable(RuntimeError):
    """The kernels cannot be built or run here; the message says why."""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    return cache_root() / "native"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeKernelsUnavailable("no C compiler found (set CC, or install gcc)")
    return cc


def build(directory: Path | None = None) -> Path:
    """The path of the compiled library, compiling it first if this source and flags have none yet."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"kvgrid_decode_{digest}.so"
    if target.exists():
        return target
    cc = _compiler()
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelsUnavailable(f"{cc} failed to build {SOURCE.name}: {result.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: concurrent workers never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL:
    """The kernels, ready to call; raises NativeKernelsUnavailable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeKernelsUnavailable(f"the native kernels are for x86-64, this is {platform.machine()}")
    missing = {"avx2", "fma"} - cpu_flags()
    if missing:
        raise NativeKernelsUnavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    import torch  # noqa: F401  (loaded first, so the library binds to torch's OpenMP runtime)

    try:
        lib = ctypes.CDLL(str(build()))
    except OSError as exc:
        raise NativeKernelsUnavailable(f"could not build or load the native kernels: {exc}") from exc
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib
