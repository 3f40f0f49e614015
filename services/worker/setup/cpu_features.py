"""What this CPU can do fast, read at run time (CPUs of one deployment differ: AVX2 only, AVX-512, AMX).

The fast path follows from it: with bfloat16 units (AVX512-BF16 or AMX) bfloat16 matmuls are the
fast path and ``--dtype auto`` picks bfloat16; without them bfloat16 GEMMs are emulated, so
``auto`` computes in float32, and quantized weights (int8 or GGUF blocks) take the integer dot
products of ``cpu_kernels/quant_kernels.c`` (AVX-512 VNNI, else AVX2, else its scalar loop).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    flags: frozenset[str]
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def amx_int8(self) -> bool:
        return "amx_int8" in self.flags

    @property
    def int8_gemm_rows(self) -> int | None:
        """Rows from which int8 products take oneDNN's int8 GEMM rather than the native kernel (None:
        never); see ``quant.matmul`` for why."""
        if self.amx_int8:
            return 1
        return 24 if self.avx512_vnni else None

    @property
    def avx512_vnni(self) -> bool:
        """What quant_kernels.c's fastest path needs (it checks the same at run time)."""
        return self.avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= self.flags

    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def bf16_units(self) -> bool:
        """Hardware bfloat16 dot products: without them bfloat16 matmuls are emulated and slower than float32."""
        return self.amx_bf16 or "avx512_bf16" in self.flags

    def describe(self) -> str:
        names = [("AVX2/FMA", self.avx2), ("AVX-512", self.avx512), ("VNNI", self.vnni)]
        names += [("AVX512-BF16", "avx512_bf16" in self.flags), ("AMX-BF16", self.amx_bf16)]
        found = [name for name, present in names if present] or ["no AVX2"]
        return f"{', '.join(found)} (torch kernels: {self.torch_capability})"

    def fast_path(self, dtype_name: str, quantization: str) -> str:
        """One line for the log: what the matmuls of this worker run on."""
        gemm_rows = self.int8_gemm_rows
        if quantization == "int8" and gemm_rows == 1:
            return "int8 weights through oneDNN's int8 GEMM on the AMX-INT8 units, activations as two int8 terms"
        if quantization == "int8" and gemm_rows is not None:
            return (
                f"int8 weights through AVX-512 VNNI integer dot products below {gemm_rows} rows, from there "
                "oneDNN's int8 GEMM with activations as two int8 terms (both weight layouts kept)"
            )
        if quantization != "none":
            if self.avx512_vnni:
                dots = "AVX-512 VNNI integer dot products"
            elif self.avx2:
                dots = "AVX2 integer dot products"
            else:
                dots = "portable scalar integer dot products (no AVX2)"
            return f"{quantization} weights through {dots}, activations in {dtype_name}"
        if dtype_name == "bfloat16" and self.bf16_units:
            unit = "AMX" if self.amx_bf16 else "AVX512-BF16"
            return f"bfloat16 matmuls on the {unit} units"
        if dtype_name == "bfloat16":
            return "bfloat16 weights multiplied in float32 (no bfloat16 units)"
        return f"{dtype_name} matmuls"


@functools.cache
def detect(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    import torch

    return CpuFeatures(frozenset(cpu_flags(cpuinfo)), torch.backends.cpu.get_cpu_capability())
