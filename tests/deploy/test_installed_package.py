"""kvgrid installed the way the images install it (`pip install .`, not editable), and what the worker derives from it.

An editable install reads the source tree, so it hides files that `pyproject.toml` does not package; the
images install a built copy. The fresh venv here gets the project with `--no-deps` and borrows the
repository venv's third-party packages through a path entry (not its `.pth` files, which would bring the
editable finder back), so it needs no network and takes seconds.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from services.worker.cpu_kernels import library
from services.worker.setup import gguf_cache
from services.worker.setup.loader import ModelSource
from tests.deploy import compose
from tests.deploy.test_dockerfiles import _instructions

pytestmark = pytest.mark.timeout(300)

# what the images copy into their build stage (docker/*.Dockerfile)
PROJECT = ("pyproject.toml", "README.md", "kvgrid", "services", "kernels")
LIBRARIES = [value for value in vars(library).values() if isinstance(value, library.Library)]


def _site_packages(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with kvgrid installed non-editable from a copy of the project; its python."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "src"
    for name in PROJECT:
        path = compose.ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(path, source / name)
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    # a plain path line: the repository venv's packages (torch, setuptools, ...) without running its .pth files
    (_site_packages(env_dir) / "kvgrid-test-deps.pth").write_text(f"{_site_packages(Path(sys.prefix))}\n")
    python = env_dir / "bin" / "python"
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    command += ["--no-build-isolation", "--no-index", str(source)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return python


def _run(python: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Python code in the installed venv, isolated from the repository (-I: no cwd, no PYTHONPATH)."""
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), **env}
    return subprocess.run([str(python), "-I", "-c", code], env=environ, cwd=cwd, capture_output=True, text=True)


def test_the_project_is_installed_as_a_copy(installed, tmp_path):
    proc = _run(installed, "import services, kvgrid.cli; print(services.__file__)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    where = Path(proc.stdout.strip())
    assert where.is_relative_to(installed.parent.parent), f"services imported from {where}, not the install"


def test_the_worker_image_prebuild_step_builds_every_native_kernel_from_the_installed_copy(installed, tmp_path):
    """The worker Dockerfile's prebuild command, run as written against the non-editable install."""
    runs = [arg for word, arg in _instructions("worker") if word == "RUN" and "cpu_kernels.library" in arg]
    assert len(runs) == 1, runs
    words = shlex.split(runs[0])
    code = words[words.index("-c") + 1]
    cache = tmp_path / "cache"
    proc = _run(installed, code, tmp_path, KVGRID_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = {path.name.rsplit("_", 1)[0] for path in (cache / "native").glob("*.so")}
    assert len(LIBRARIES) >= 3 and built == {f"kvgrid_{lib.source.stem}" for lib in LIBRARIES}
    for path in (cache / "native").glob("*.so"):  # built as root, loaded by the image's own user
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, f"{path.name} is not readable by others"


class _Saves:
    """Stands in for a transformers config or tokenizer: save_pretrained writes one file."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, directory) -> None:
        (Path(directory) / self.name).write_text("{}")


def test_a_converted_model_is_readable_by_other_users(tmp_path, monkeypatch):
    """An image converts the default model as root and runs as uid 10001: the entry must not be private."""
    import torch

    monkeypatch.setattr(gguf_cache, "read_config", lambda source: (_Saves("config.json"), None))
    monkeypatch.setattr(gguf_cache, "load_tokenizer", lambda source: _Saves("tokenizer.json"))
    monkeypatch.setattr(gguf_cache, "iter_weights", lambda source, config: iter([("w", torch.zeros(2))]))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    old = os.umask(0o022)
    try:
        converted = gguf_cache.cached_source(ModelSource(str(gguf), "gguf"), tmp_path / "cache")
    finally:
        os.umask(old)
    target = Path(converted.path)
    assert converted.format == "safetensors" and (target / gguf_cache.DONE_MARKER).is_file()
    for path in [target, *target.iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        wanted = 0o755 if path.is_dir() else 0o644
        assert mode == wanted, f"{path.name} has mode {oct(mode)}, not {oct(wanted)}"
