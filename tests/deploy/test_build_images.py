"""docker/build_images.py and docker/base-image.sh without building: what they pass to the engine."""

from __future__ import annotations

import importlib.util
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.deploy import compose

_spec = importlib.util.spec_from_file_location("build_images", compose.ROOT / "docker/build_images.py")
build_images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_images)


def _fake_python(tmp_path: Path, output: str) -> str:
    """An interpreter whose `-m pip config list` prints ``output``."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    script.chmod(0o755)
    return str(script)


def test_pip_settings_come_from_the_variables_first_then_install_then_global(tmp_path):
    python = _fake_python(
        tmp_path,
        "global.index-url='https://mirror.example/simple'\n"
        "global.find-links='/a'\n"
        "install.find-links='/b /c'\n"
        ":env:.find-links='/d'\n"
        "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "download.extra-index-url='https://other.example/simple'",
    )
    assert build_images.pip_config(python) == {
        "index-url": "https://mirror.example/simple",
        "find-links": "/d",
        "cert": "/etc/ssl/certs/ca-certificates.crt",
    }


@pytest.fixture
def served():
    packages = build_images.LocalPackages()
    yield packages
    packages.close()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_local_indexes_and_links_are_served_read_only_and_nothing_beside_them(tmp_path, served, monkeypatch):
    index = tmp_path / "mirror" / "simple" / "pkg"
    index.mkdir(parents=True)
    (index / "index.html").write_text('<a href="../../files/pkg-1.0-py3-none-any.whl">pkg</a>')
    (tmp_path / "mirror" / "files").mkdir()
    (tmp_path / "mirror" / "files" / "pkg-1.0-py3-none-any.whl").write_bytes(b"wheel")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"torch")
    (tmp_path / "secret").write_text("not served")
    monkeypatch.setenv("KVGRID_BUILD_CA_CERT", str(tmp_path / "ca.pem"))
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    config = {
        "index-url": "https://pypi.example/simple",
        "extra-index-url": f"file://{tmp_path}/mirror/simple https://extra.example/simple",
        "find-links": str(wheels),
        "cert": "/etc/ssl/certs/ca-certificates.crt",
    }
    args = build_images.package_args(config, served)
    base = f"http://127.0.0.1:{served.server.server_port}"
    assert args == {
        "PIP_INDEX_URL": "https://pypi.example/simple",
        "PIP_EXTRA_INDEX_URL": f"{base}{tmp_path}/mirror/simple/ https://extra.example/simple",
        "PIP_FIND_LINKS": f"{base}{wheels}/",
        "EXTRA_CA_CERT": (tmp_path / "ca.pem").read_text(),
    }
    # the index's page and the file it links to beside "simple"; the links directory's listing and wheel
    assert b"../../files/pkg-1.0" in _get(f"{base}{tmp_path}/mirror/simple/pkg/")[1]
    assert _get(f"{base}{tmp_path}/mirror/files/pkg-1.0-py3-none-any.whl") == (200, b"wheel")
    assert b"torch-2.13.0%2Bcpu" in _get(args["PIP_FIND_LINKS"])[1]
    for outside in (f"{tmp_path}/secret", "/etc/passwd", f"{wheels}/../secret"):
        assert _get(base + outside)[0] == 404, outside


def test_without_a_configured_cert_no_ca_is_passed(monkeypatch, served):
    monkeypatch.delenv("KVGRID_BUILD_CA_CERT", raising=False)
    assert build_images.package_args({}, served) == {}


def test_the_images_are_those_compose_builds_outside_profiles():
    images = build_images.compose_images(compose.COMPOSE_FILE, [])
    services = compose.load()["services"]
    assert set(images) == {services[name]["image"] for name in compose.KVGRID_SERVICES}
    worker = images[services["worker"]["image"]]
    assert worker["dockerfile"] == "docker/worker.Dockerfile" and worker["args"] == {"DEVICE": "cpu"}
    assert worker["directory"] == compose.ROOT
    assert build_images.dockerfile_arg(compose.ROOT / "docker/worker.Dockerfile", "TORCH_VERSION") == "2.13.0"


def _fake_tools(tmp_path: Path, present: str) -> dict[str, str]:
    """PATH with a `podman` that has only image ``present``, pulls nothing and records imports, and an
    `mmdebstrap` that records its arguments and writes its tarball."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "image inspect" ]; then [ "$3" = "{present}" ]; exit; fi\n'
        f'if [ "$1" = import ]; then echo "$@" > {tmp_path}/import.args; exit 0; fi\n'
        "exit 125\n"
    )
    (bin_dir / "mmdebstrap").write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/mmdebstrap.args\nfor a; do case "$a" in *.tar) touch "$a";; esac; done\n'
    )
    for tool in ("podman", "mmdebstrap"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PULL_TIMEOUT": "5"}


def _base_image(tmp_path: Path, present: str) -> subprocess.CompletedProcess:
    script = str(compose.ROOT / "docker/base-image.sh")
    return subprocess.run([script], env=_fake_tools(tmp_path, present), capture_output=True, text=True, timeout=60)


def test_the_base_image_is_the_dockerfiles_default_when_the_engine_has_it(tmp_path):
    default = build_images.dockerfile_arg(compose.ROOT / "docker/worker.Dockerfile", "PYTHON_IMAGE")
    proc = _base_image(tmp_path, default)
    assert (proc.returncode, proc.stdout) == (0, default + "\n"), proc.stderr
    assert not (tmp_path / "mmdebstrap.args").exists()


def test_where_no_registry_answers_the_base_image_is_bootstrapped_and_imported(tmp_path):
    proc = _base_image(tmp_path, "none")
    assert (proc.returncode, proc.stdout) == (0, "localhost/kvgrid-python:3.11-bookworm\n"), proc.stderr
    bootstrap = (tmp_path / "mmdebstrap.args").read_text()
    assert "bookworm" in bootstrap.split() and "python3,python3-venv,python-is-python3" in bootstrap
    assert "deb http://deb.debian.org/debian bookworm main" in bootstrap
    assert (tmp_path / "import.args").read_text().split()[-1] == "localhost/kvgrid-python:3.11-bookworm"


def test_every_dockerfile_builds_from_the_same_base():
    dockerfiles = [compose.ROOT / f"docker/{role}.Dockerfile" for role in compose.KVGRID_SERVICES]
    assert len({build_images.dockerfile_arg(path, "PYTHON_IMAGE") for path in dockerfiles}) == 1
