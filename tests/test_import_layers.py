"""The layer contracts in pyproject.toml ([tool.importlinter]) hold, and `lint-imports` does catch a breach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("kvgrid", "services", "kernels")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    assert LINT_IMPORTS.exists(), "lint-imports is missing: install the dev extra (`make install`)"
    # Wide enough that no contract name is wrapped; no cache directory is left in the tree.
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "250", "NO_COLOR": "1"}
    argv = [str(LINT_IMPORTS), str(cwd / "pyproject.toml"), "--no-cache", "--no-logo"]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def contract_name(pyproject: Path, source: str, forbidden: str) -> str:
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    (name,) = (
        c["name"]
        for c in contracts
        if source in c.get("source_modules", ()) and forbidden in c.get("forbidden_modules", ())
    )
    return name


def test_the_repository_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_tokenizer_module_that_imports_torch_breaks_its_contract(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "services" / "tokenizer" / "planted_violation.py").write_text("import torch\n")

    result = lint_imports(tmp_path)
    assert result.returncode != 0
    name = contract_name(tmp_path / "pyproject.toml", "services.tokenizer", "torch")
    assert f"{name} BROKEN" in result.stdout, result.stdout
    assert "services.tokenizer.planted_violation -> torch" in result.stdout, result.stdout
