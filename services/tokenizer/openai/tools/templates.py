"""The chat templates kvgrid ships for tool calling, and ``--chat-template``'s reading: a shipped template's
name or a Jinja file's path."""

from __future__ import annotations

import functools
import os
from importlib import resources

SHIPPED = ("hermes", "llama3_json", "mistral", "pythonic")


@functools.cache
def shipped_template(name: str) -> str:
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def read_chat_template(value: str) -> str:
    """The template source ``--chat-template`` names: a shipped template, or a file. Raises ValueError."""
    if value in SHIPPED:
        return shipped_template(value)
    if not os.path.isfile(value):
        raise ValueError(f"--chat-template {value!r} is neither a file nor one of {', '.join(SHIPPED)}")
    with open(value, encoding="utf-8") as f:
        return f.read()
