"""Tensor parallel: one worker over several devices (see ranks.py)."""
