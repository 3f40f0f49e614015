"""Where the worker keeps what it derives once and reuses on later starts (native kernels, converted models).

An entry may be read by another user than the one who wrote it (an image writes its cache at build time
as root and runs as uid 10001), so entries take the modes a plain ``mkdir``/``open`` gives (0777/0666
less the umask), not private ones: ``new_sibling_dir`` and ``match_dir_modes``.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def cache_root() -> Path:
    """``$KVGRID_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvgrid``, else ``~/.cache/kvgrid``."""
    root = os.environ.get("KVGRID_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvgrid"
    )
    return Path(root)


def new_sibling_dir(parent: Path, prefix: str) -> Path:
    """A fresh, uniquely named directory in ``parent``, to be filled and then renamed into place.

    Unlike ``tempfile.mkdtemp`` (0700) it has the umask's mode, which it keeps once renamed.
    """
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free temporary name for {prefix}* in {parent}")


def match_dir_modes(directory: Path) -> None:
    """Give every file directly in ``directory`` the directory's read and write bits (0666 less the umask,
    when ``new_sibling_dir`` made it): some writers, safetensors among them, create their files 0600."""
    mode = stat.S_IMODE(directory.stat().st_mode) & 0o666
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
