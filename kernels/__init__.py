"""Triton kernels for kvgrid, each in its own module with its launcher; plain-torch references of the
same signatures live in ``kernels.reference``.

- ``paged_attention``: varlen paged attention (prefill chunks and decodes in one launch, GQA,
  optional split-KV), combined by ``split_kv_reduce`` when split.
- ``kv_cache_write``: scatter a step's new keys and values into their cache slots.
- ``fused_moe``: mixture-of-experts feed-forward as grouped GEMMs over the tokens routed to each expert.
- ``rms_norm``: RMSNorm fused with the residual add (tested, not wired into the model: unmeasured).

Importing a module imports triton; with TRITON_INTERPRET=1 set before that, kernels run on CPU tensors.
"""
