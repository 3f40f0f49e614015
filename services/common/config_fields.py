"""How a configuration field is declared: its flag name, its help and parsing (``option``), and byte sizes."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any


def flag_name(name: str) -> str:
    return name.replace("_", "-")


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, parse=None, many: bool = False):
    """``many``: the flag takes several values (``--lora-modules a=/x b=/y``), joined by spaces into the string."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse, "many": many})


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1000000' -> bytes."""
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
