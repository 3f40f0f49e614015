"""LoRA adapters on the worker: PEFT checkpoints loaded (``adapter``), a device slot table with a host copy
(``slots``), and each batch row's adapter applied to the projections it targets (``apply``)."""
