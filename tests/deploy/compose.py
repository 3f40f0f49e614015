"""Reading docker-compose.yml the way `docker compose` does, for tests that run its services locally."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_COMPOSE_FILE = ROOT / "docker-compose.gpu.yml"
KVGRID_SERVICES = ("worker", "scheduler", "tokenizer")

# ${VAR}, ${VAR:-default}, ${VAR-default} and $$ (a literal $), as compose interpolates them
_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")
_HOST_PORT = re.compile(r"^(?P<host>[a-z0-9][a-z0-9_.-]*):(?P<port>\d+)$")


def interpolate(value, environ: dict[str, str]):
    """Substitute variables in every string of a parsed compose document."""
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group("name", "op", "default")
        if op == ":-":
            return environ.get(name) or default
        if op == "-":
            return environ.get(name, default)
        return environ.get(name, "")

    return _VARIABLE.sub(substitute, value)


def load(path: Path = COMPOSE_FILE, environ: dict[str, str] | None = None) -> dict:
    """The compose document with YAML anchors merged and variables interpolated (empty shell by default).

    An environment variable listed without a value takes the shell's value, and stays None (unset in the
    container) when the shell has none.
    """
    environ = environ or {}
    doc = interpolate(yaml.safe_load(path.read_text()), environ)
    for service in (doc.get("services") or {}).values():
        env = service.get("environment")
        if isinstance(env, dict):
            service["environment"] = {k: environ.get(k) if v is None else v for k, v in env.items()}
    return doc


def environment(service: dict) -> dict[str, str]:
    """A service's environment as strings, without the variables left unset (compose takes both the mapping
    and the KEY=VALUE list form)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items() if v is not None}


def container_ports(service: dict) -> set[int]:
    """Ports the service listens on inside its container: `expose` plus the container side of `ports`."""
    found = {int(p) for p in service.get("expose") or []}
    for spec in service.get("ports") or []:
        found.add(int(str(spec).split(":")[-1].split("/")[0]))
    return found


def localize(
    services: dict[str, dict], port_map: dict[tuple[str, int], int], name: str, env: dict[str, str]
) -> dict[str, str]:
    """One service's environment for a local process: its own ports and `host:port` peers remapped.

    Raises AssertionError naming the variable when the compose file points at a port nobody exposes,
    or exposes a port that no *_PORT variable sets (so the local run could not move it).
    """
    own = container_ports(services[name])
    out, set_ports = {}, set()
    for key, value in env.items():
        m = _HOST_PORT.match(value)
        if key.endswith("_PORT") and value.isdigit():
            port = int(value)
            assert port in own, f"{name}: {key}={value} is not among the ports it exposes {sorted(own)}"
            out[key], set_ports = str(port_map[(name, port)]), set_ports | {port}
        elif m and m.group("host") in services:
            peer, port = m.group("host"), int(m.group("port"))
            assert (peer, port) in port_map, f"{name}: {key}={value} but {peer} does not expose {port}"
            out[key] = f"127.0.0.1:{port_map[(peer, port)]}"
        else:
            out[key] = value
    missing = own - set_ports
    assert not missing, f"{name} exposes {sorted(missing)} but sets no KVGRID_*_PORT to it"
    return out


def localize_args(args: list[str], port_map: dict[tuple[str, int], int], name: str) -> list[str]:
    """A health-check command with `localhost:PORT` moved to the service's local port."""
    out = []
    for arg in args:
        m = re.fullmatch(r"(localhost|127\.0\.0\.1):(\d+)", arg)
        out.append(f"127.0.0.1:{port_map[(name, int(m.group(2)))]}" if m else arg)
    return out


def startup_order(services: dict[str, dict], names: tuple[str, ...]) -> list[str]:
    """`names` ordered so that every service comes after the ones it depends on."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join(path + (name,))}"
        if name in order:
            return
        for dep in services[name].get("depends_on") or {}:
            if dep in names:
                visit(dep, path + (name,))
        order.append(name)

    for name in names:
        visit(name, ())
    return order


def seconds(duration: str | int | float) -> float:
    """Compose durations: '300s', '1m30s', '500ms'."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a compose duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)
