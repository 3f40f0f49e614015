"""Native CPU kernels, built from C at first use: float decode steps (AVX2 + FMA) and quantized linears."""
