"""Triton kernel tests: each kernel against its torch reference, through the interpreter on CPU."""
