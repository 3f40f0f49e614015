"""Where every benchmark writes its result, and what each result file records about its run.

``save(name, payload)`` writes ``benchmarks/results/<name>.json``: the benchmark's own payload plus
``run``, which names the machine (CPU model, cores, torch version, GPU if one was used), the exact
command line, the git commit and a UTC timestamp, so that a figure in the docs can be traced to a
file and the file to a run. ``python -m benchmarks.tables`` turns these files into the docs' tables.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS_DIR.parent.parent


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor string elsewhere)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_name() -> str | None:
    """The GPU, when this process loaded torch and CUDA is there (a benchmark that never imports torch ran none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def command() -> str:
    """The command line that started this process, as one would type it again (`python -m benchmarks.x ...`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def git(*args: str) -> str:
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def dirty() -> bool:
    """Whether tracked files differ from the commit, result files aside: a run that follows another (``make bench``,
    or two peer benchmarks back to back) finds the first one's JSON written and still measures the commit."""
    return bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"))


def run_info() -> dict:
    return {
        "command": command(),
        "commit": git("rev-parse", "--short", "HEAD") or "unknown",
        "dirty": dirty(),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch": torch_version(),
            "gpu": gpu_name(),
            "python": platform.python_version(),
        },
    }


def save(name: str, payload: dict, path: str | os.PathLike | None = None) -> pathlib.Path:
    """Writes ``payload`` with its ``run`` record to ``benchmarks/results/<name>.json`` (or ``path``)."""
    out = pathlib.Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": name, "run": run_info(), **payload}, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return out
