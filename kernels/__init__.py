"""Triton kernels for kvgrid, each beside a plain-torch reference of the same signature."""
