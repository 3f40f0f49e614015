"""Compile every kernel for NVIDIA targets without a GPU: ``python -m tests.kernels.compile_for_cuda 80 90``.

The interpreter runs kernels as Python, so it cannot catch what only the compiler rejects (loop-carried
types, early returns, dot shapes, shared-memory limits). Triton compiles ahead of time for any
``GPUTarget`` with its bundled ptxas, no driver needed. Must run with TRITON_INTERPRET unset, so the
kernels are real JIT functions: test_cuda_compile.py starts it as a subprocess.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from kernels.kv_cache_write import kv_cache_write_kernel
from kernels.paged_attention import paged_attention_kernel
from kernels.rms_norm import rms_norm_kernel
from kernels.split_kv_reduce import split_kv_reduce_kernel

# (dtype, head_dim, queries_per_kv, block_m, num_splits): decode and prefill tilings, a padded
# head dim, float32's exact dot, and the split-KV epilogue.
ATTENTION_VARIANTS = [
    ("fp16", 128, 4, 16, 1),
    ("bf16", 80, 8, 64, 4),
    ("fp32", 64, 3, 64, 1),
]


def compile_kernel(fn, pointer_types: dict[str, str], constexprs: dict[str, object], target: GPUTarget):
    """Arguments not named in pointer_types or constexprs are int32 scalars."""
    signature = {name: pointer_types.get(name, "i32") for name in fn.arg_names}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    const_by_index = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const_by_index), target=target)


def compile_all(arch: int) -> list[str]:
    target = GPUTarget("cuda", arch, 32)
    done = []
    for dtype, head_dim, queries_per_kv, block_m, num_splits in ATTENTION_VARIANTS:
        types = dict.fromkeys(["out_ptr", "query_ptr", "k_cache_ptr", "v_cache_ptr"], f"*{dtype}")
        types |= dict.fromkeys(["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"], "*i32")
        types |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "scale": "fp32"}
        constexprs = dict(
            HEAD_DIM=head_dim,
            HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=16,
            QUERIES_PER_KV=queries_per_kv,
            BLOCK_Q=block_m // queries_per_kv,
            BLOCK_M=block_m,
            TILE_N=32,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            DOT_IN_FP32=False,
            NUM_SPLITS=num_splits,
        )
        compile_kernel(paged_attention_kernel, types, constexprs, target)
        done.append(f"paged_attention {dtype} d={head_dim} g={queries_per_kv} m={block_m} splits={num_splits}")
    types = dict.fromkeys(["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"], "*fp16")
    types["slot_mapping_ptr"] = "*i64"
    constexprs = dict(NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_DIM=80, HEAD_PAD=128, BLOCK_SIZE=16)
    compile_kernel(kv_cache_write_kernel, types, constexprs, target)
    done.append("kv_cache_write")
    types = {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    compile_kernel(split_kv_reduce_kernel, types, dict(HEAD_DIM=80, HEAD_PAD=128, NUM_SPLITS=3, SPLITS_PAD=4), target)
    done.append("split_kv_reduce")
    types = dict.fromkeys(["out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr"], "*bf16")
    types["eps"] = "fp32"
    compile_kernel(rms_norm_kernel, types, dict(HIDDEN=576, HIDDEN_PAD=1024, HAS_RESIDUAL=True), target)
    done.append("rms_norm")
    return done


if __name__ == "__main__":
    for arch in sys.argv[1:]:
        for line in compile_all(int(arch)):
            print(f"compiled sm_{arch}", line)
