"""Build the images of docker-compose.yml with this machine's package setup, one at a time.

    .venv/bin/python docker/build_images.py                  # podman: tokenizer, scheduler, worker (CPU)
    .venv/bin/python docker/build_images.py --engine docker worker

Each image gets the name, Dockerfile and build args compose gives it, plus this builder's setup
through the Dockerfiles' declared build args (nothing podman-only):
- PYTHON_IMAGE from docker/base-image.sh: the default image, or a local one where no registry answers;
- PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS from pip's configuration here (`pip config list`,
  which includes PIP_* variables); local directories among them (file:// indexes, find-links paths)
  are served read-only on 127.0.0.1 while the builds run on the host network;
- EXTRA_CA_CERT when pip is told which CAs to trust (its `cert`): $KVGRID_BUILD_CA_CERT, else the CAs
  added to this machine (/usr/local/share/ca-certificates/*.crt);
- TORCH_CPU_INDEX_URL empty (that setup as is) when it offers a CPU build of the worker's pinned torch.
Prints one line per image with its build time and size.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
# pip's sources, by precedence: PIP_* variables, then the install command's section, then [global]
SECTIONS = (":env:", "install", "global")


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's effective setting per option name (index-url, find-links, cert, ...)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    found: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        found.setdefault(option, {})[section] = value.strip().strip("'\"")
    return {option: next(v[s] for s in SECTIONS if s in v) for option, v in found.items() if set(v) & set(SECTIONS)}


def _local_dir(location: str) -> Path | None:
    if location.startswith("file:"):
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(location).path))
    elif "://" in location:
        return None
    else:
        path = Path(location)
    return path if path.is_dir() else None


class LocalPackages:
    """Local index and find-links directories, served read-only over HTTP on 127.0.0.1 (URL path = file path).

    On PORT when it is free: the URLs are build args, and the same ones let the engine reuse its cached layers.
    """

    PORT = int(os.environ.get("KVGRID_BUILD_PACKAGES_PORT", "38741"))

    def __init__(self) -> None:
        self.roots: list[Path] = []
        handler = functools.partial(_Handler, roots=self.roots)
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.PORT), handler)
        except OSError:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, location: str, index: bool) -> str:
        """``location`` as the build sees it: local directories become URLs of this server."""
        path = _local_dir(location)
        if path is None:
            return location
        path = path.resolve()
        # an index's pages link to files beside it (../../files/...): serve what holds the "simple" directory
        self.roots.append(path.parent if index and path.name == "simple" else path)
        return f"http://127.0.0.1:{self.server.server_port}{urllib.parse.quote(str(path))}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, roots: list[Path], **kwargs):
        self.roots = roots
        super().__init__(*args, **kwargs)

    def translate_path(self, path: str) -> str:
        wanted = Path(urllib.parse.unquote(urllib.parse.urlsplit(path).path)).resolve()
        if any(wanted == root or root in wanted.parents for root in self.roots):
            return str(wanted)
        return "/nonexistent"  # 404: nothing outside the configured directories

    def log_message(self, format: str, *args) -> None:
        pass


def extra_ca_cert(config: dict[str, str]) -> str:
    """PEM text of the CAs the build must trust besides the image's own."""
    chosen = os.environ.get("KVGRID_BUILD_CA_CERT")
    if chosen:
        return Path(chosen).read_text()
    if "cert" not in config or not LOCAL_CAS.is_dir():
        return ""
    return "".join(path.read_text() for path in sorted(LOCAL_CAS.rglob("*.crt")))


def package_args(config: dict[str, str], served: LocalPackages) -> dict[str, str]:
    args = {}
    if "index-url" in config:
        args["PIP_INDEX_URL"] = served.url(config["index-url"], index=True)
    for option, index in (("extra-index-url", True), ("find-links", False)):
        if option in config:
            args["PIP_" + option.upper().replace("-", "_")] = " ".join(
                served.url(location, index) for location in config[option].split()
            )
    cert = extra_ca_cert(config)
    if cert:
        args["EXTRA_CA_CERT"] = cert
    return args


def dockerfile_arg(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S*)", dockerfile.read_text(), re.M)
    assert match, f"{dockerfile} declares no ARG {name}"
    return match.group(1)


def offers_cpu_torch(version: str, python: str = sys.executable) -> bool:
    """Whether pip here resolves torch==VERSION to a CPU build (a local version such as 2.13.0+cpu)."""
    command = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
    proc = subprocess.run([*command, "--report", "-", f"torch=={version}"], capture_output=True, text=True)
    if proc.returncode != 0:
        return False
    installs = json.loads(proc.stdout)["install"]
    return bool(installs) and installs[0]["metadata"]["version"].endswith("+cpu")


def compose_images(compose_file: Path, names: list[str]) -> dict[str, dict]:
    """image -> {dockerfile, context, args} of the compose services that build one (profiles left out)."""
    services = yaml.safe_load(compose_file.read_text())["services"]
    images = {}
    for name, service in services.items():
        if "build" not in service or (names and name not in names) or (not names and service.get("profiles")):
            continue
        build = service["build"]
        spec = {"image": service["image"], "dockerfile": build["dockerfile"], "context": build.get("context", ".")}
        spec["args"] = {k: str(v) for k, v in (build.get("args") or {}).items()}
        assert "$" not in json.dumps(spec), f"{name}: variables in build settings are not supported here: {spec}"
        images.setdefault(service["image"], {**spec, "directory": compose_file.resolve().parent})
    missing = set(names) - set(services)
    assert not missing, f"no such services in {compose_file}: {sorted(missing)}"
    return images


def build(engine: str, spec: dict, args: dict[str, str]) -> tuple[float, int]:
    """Build one image (paths relative to the compose file's directory); its build time (s) and size (bytes)."""
    context = spec["directory"] / spec["context"]
    command = [engine, "build", "--network", "host", "-t", spec["image"], "-f", str(context / spec["dockerfile"])]
    for key, value in {**args, **spec["args"]}.items():
        command += ["--build-arg", f"{key}={value}"]
    started = time.monotonic()
    subprocess.run([*command, str(context)], check=True)
    seconds = time.monotonic() - started
    size = subprocess.run(
        [engine, "image", "inspect", "--format", "{{.Size}}", spec["image"]], capture_output=True, text=True, check=True
    ).stdout
    return seconds, int(size.split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("services", nargs="*", help="compose services to build (default: all outside profiles)")
    parser.add_argument("--engine", default=os.environ.get("CONTAINER_ENGINE", "podman"), help="podman or docker")
    parser.add_argument("--compose-file", type=Path, default=ROOT / "docker-compose.yml")
    opts = parser.parse_args(argv)

    images = compose_images(opts.compose_file, opts.services)
    env = dict(os.environ, CONTAINER_ENGINE=opts.engine)
    base = subprocess.run([str(ROOT / "docker/base-image.sh")], env=env, stdout=subprocess.PIPE, text=True)
    if base.returncode != 0:
        print("build_images: no base image (docker/base-image.sh failed)", file=sys.stderr)
        return 1
    config = pip_config()
    served = LocalPackages()
    try:
        common = {"PYTHON_IMAGE": base.stdout.strip(), **package_args(config, served)}
        torch = dockerfile_arg(ROOT / "docker/worker.Dockerfile", "TORCH_VERSION")
        if offers_cpu_torch(torch):
            common["TORCH_CPU_INDEX_URL"] = ""
        shown = {k: ("<PEM>" if k == "EXTRA_CA_CERT" else v) for k, v in common.items()}
        print(f"build_images: {opts.engine}, build args {shown}", flush=True)
        for image, spec in images.items():
            seconds, size = build(opts.engine, spec, common)
            print(f"build_images: {image} built in {seconds:.0f} s, {size / 1e6:.0f} MB", flush=True)
    finally:
        served.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
