"""Where the worker keeps what it derives once and reuses on later starts (native kernels, converted models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVGRID_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvgrid``, else ``~/.cache/kvgrid``."""
    root = os.environ.get("KVGRID_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvgrid"
    )
    return Path(root)
