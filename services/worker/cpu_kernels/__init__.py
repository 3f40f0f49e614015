"""Native CPU kernels for small decode steps (AVX2 + FMA), built from C at first use."""
