"""The worker service: owns the device, the weights and the paged KV cache.

Modules: ``loader`` (HF directory / GGUF -> config, weights, tokenizer), ``models/`` (one file per
architecture family), ``attention/`` (backends), ``kv_cache`` and ``memory`` (sizing the cache),
``state`` (per-request state from step plans), ``model_runner`` (plan -> tensors -> forward ->
sample), ``engine`` (all of it without gRPC), ``core``/``service``/``server``/``main`` (serving).
"""
