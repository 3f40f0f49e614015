"""The scheduler never imports torch (its image has none), nor the structured-output library: it carries
SamplingParams to the worker untouched.

import-linter's contracts in pyproject.toml state the same of the scheduler's own import statements. These
tests check what importing does at run time, which the static graph cannot see: imports that third-party
packages make in turn (import-linter stops at the first external module), and modules loaded by name
(importlib)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import services.scheduler


def _imports_torch(modules: list[str], name: str = "torch") -> bool:
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += f"print({name!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip() == "True"


def test_main_does_not_import_torch():
    assert not _imports_torch(["services.scheduler.server"])


def test_no_module_of_the_package_imports_torch():
    modules = [m.name for m in pkgutil.walk_packages(services.scheduler.__path__, "services.scheduler.")]
    assert "services.scheduler.engine" in modules and len(modules) >= 10
    assert not _imports_torch(modules)


def test_no_module_of_the_package_imports_llguidance():
    modules = [m.name for m in pkgutil.walk_packages(services.scheduler.__path__, "services.scheduler.")]
    assert not _imports_torch(modules, "llguidance")
