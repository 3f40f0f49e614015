"""Offline inference: ``LLM`` (scheduler core + model runner in one process) and ``kvgrid run-batch``.

This package is the one place that joins the scheduler core and the worker's runner; it never
imports a gRPC servicer.
"""
