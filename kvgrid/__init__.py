"""kvgrid: an LLM serving system split into tokenizer, scheduler and worker services."""

__version__ = "0.1.0"
