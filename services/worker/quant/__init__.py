"""Quantized weights (``--quantization``): formats, packing, reading GGUF blocks, and their matmuls."""
