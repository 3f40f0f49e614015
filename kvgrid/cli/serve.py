"""`kvgrid serve`: the three services as child processes on one machine, supervised together.

The worker, scheduler and tokenizer start at once (the scheduler dials the worker
with backoff, the frontend waits for the scheduler), each with its own flags from
the shared configuration. `serve` waits until every gRPC health check answers
SERVING, prints the endpoints, and then stays in the foreground. A child that
dies after that is restarted with backoff (a worker's requests wait for it in the
scheduler); one that keeps dying (see ``RestartPolicy``) stops the stack with exit
code 1, as does any child dying during start-up. Ctrl-C or SIGTERM drains in
order: the frontend first (its streams finish within --shutdown-grace), then the
scheduler, then the worker.

Only the frontend's ports face the network (`--host`): the scheduler, the worker and
their metrics listen on 127.0.0.1, since on one machine only the frontend calls them.
Secrets (`--api-key`) reach the frontend in its environment, never on a command line,
where `ps` would show them to every user of the machine.

On a small machine the three services share the cores, and the worker's OpenMP team
(one thread per core) loses a core whenever the frontend or scheduler wakes. The
native kernels hand work out dynamically, so a thread that loses its core delays
only its chunk; and the team's idle threads spin (``GOMP_SPINCOUNT``) long enough
to catch the next parallel region of a step, which Python glue separates from the
last, instead of paying a wake-up each time (see ``worker_arrangement``). A user's
own OpenMP settings win.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvgrid.cli.probes import INTERNAL_SERVICES, PUBLIC_SERVICE, is_serving, readiness_probe
from services.common import config as cfg

# Order of start-up and of the summary; shutdown runs in reverse (frontend first).
SERVICE_ORDER = ("worker", "scheduler", "tokenizer")
# The services only the frontend calls (INTERNAL_SERVICES) listen on loopback, whatever --host is.
INTERNAL_HOST = "127.0.0.1"
INTERNAL_PORTS = ("scheduler_port", "scheduler_metrics_port", "worker_port", "worker_metrics_port")
# Beyond its --shutdown-grace, how long a stopping child may take to close before it is killed.
STOP_MARGIN_SECONDS = 10.0
POLL_SECONDS = 0.5


# Restarts: exponential backoff, and a limit on crashes in a window.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# More crashes than this within the window stop the stack: a child that keeps dying needs a person.
MAX_CRASHES = 5
WINDOW_S = 120.0


@dataclass(slots=True)
class RestartPolicy:
    first_backoff: float = FIRST_BACKOFF_S
    max_backoff: float = MAX_BACKOFF_S
    max_crashes: int = MAX_CRASHES
    window: float = WINDOW_S
    _crashes: deque[float] = field(default_factory=deque)

    def crashed(self, now: float) -> float | None:
        """Record a crash at ``now``; the seconds to wait before restarting, or None when it crashed too often."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window:
            self._crashes.popleft()
        if len(self._crashes) > self.max_crashes:
            return None
        return min(self.first_backoff * 2 ** (len(self._crashes) - 1), self.max_backoff)

    @property
    def num_recent(self) -> int:
        return len(self._crashes)


SPIN = "300000"  # libgomp spin iterations (its default), set explicitly so the arrangement does not depend on the build
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_arrangement(num_threads: int, num_cores: int, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(variables to add to the worker's environment, one line for the log)."""
    threads = num_threads or num_cores
    own = [f"{name}={environ[name]}" for name in OPENMP_VARIABLES if name in environ]
    if own:
        return {}, f"worker: {threads} threads, OpenMP waits as set ({', '.join(own)})"
    if threads + 2 <= num_cores:
        return {}, f"worker: {threads} threads on {num_cores} cores, cores to spare for frontend and scheduler"
    return (
        {"GOMP_SPINCOUNT": SPIN},
        f"worker: {threads} threads sharing {num_cores} cores with frontend and scheduler;"
        f" idle threads spin through a step's gaps, then sleep (GOMP_SPINCOUNT={SPIN})",
    )


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    grpc_addr: str
    process: subprocess.Popen | None = None
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    # When a crashed child is due to start again (monotonic seconds); None while it runs.
    restart_at: float | None = None
    env: dict[str, str] | None = None  # added to serve's own environment
    # Whether the child reports SERVING (default: the plaintext gRPC health check of grpc_addr).
    probe: Callable[[], bool] | None = None


def _say(text: str) -> None:
    print(f"kvgrid serve: {text}", flush=True)


def dial_host(host: str) -> str:
    """Where local clients reach a server bound to `host` (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def child_config(config: cfg.Config) -> cfg.Config:
    """The configuration handed to the children: internal addresses follow the ports serve binds, on loopback."""
    net = config.network
    network = dataclasses.replace(
        net,
        scheduler_addr=f"{INTERNAL_HOST}:{net.scheduler_port}",
        scheduler_addrs="",  # the local tokenizer routes to the local scheduler only
        worker_addr=f"{INTERNAL_HOST}:{net.worker_port}",
    )
    return dataclasses.replace(config, network=network)


def service_config(name: str, config: cfg.Config) -> cfg.Config:
    """What service ``name`` runs with: the scheduler and the worker (and their metrics) bind loopback only."""
    if name not in INTERNAL_SERVICES:
        return config
    return dataclasses.replace(config, network=dataclasses.replace(config.network, host=INTERNAL_HOST))


def _sections(name: str):
    from kvgrid.cli import SERVICES

    return SERVICES[name][1]


def _attr(section) -> str:
    return section.__name__.removesuffix("Config").lower()


def _secret_fields(section) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(section) if f.metadata.get("secret")]


def service_argv(name: str, config: cfg.Config) -> list[str]:
    """`python -m kvgrid.cli NAME --flag value ...` with the flags of the sections NAME parses, secrets left out
    (see ``service_env``)."""
    argv = [sys.executable, "-m", "kvgrid.cli", name]
    config = service_config(name, config)
    for section in _sections(name):
        secret = {"--" + f.name.replace("_", "-") for f in _secret_fields(section)}
        flags = iter(cfg.to_flags(getattr(config, _attr(section))))
        for flag in flags:
            if flag in secret:
                next(flags)  # and its value
            else:
                argv.append(flag)
    return argv


def service_env(name: str, config: cfg.Config, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The secrets service ``name`` gets, as ``KVGRID_*`` variables added to serve's environment: API keys go to
    the frontend alone (the others get an inherited variable emptied)."""
    env = {}
    for section in _sections(name):
        for f in _secret_fields(section):
            value = getattr(getattr(config, _attr(section)), f.name) if name == PUBLIC_SERVICE else ""
            if value or cfg.env_name(f.name) in environ:
                env[cfg.env_name(f.name)] = value
    return env


def build_children(config: cfg.Config) -> list[Child]:
    net = config.network
    public = f"{dial_host(net.host)}:{net.tokenizer_port}"
    addrs = {
        "worker": f"{INTERNAL_HOST}:{net.worker_port}",
        "scheduler": f"{INTERNAL_HOST}:{net.scheduler_port}",
        "tokenizer": public,
    }
    children = []
    for name in SERVICE_ORDER:
        child = Child(name, service_argv(name, config), addrs[name], env=service_env(name, config))
        http_addr = (dial_host(net.host).strip("[]"), net.http_port)
        child.probe = readiness_probe(name, config.security, addrs[name], http_addr)
        children.append(child)
    return children


def arrange_worker_threads(config: cfg.Config, worker: Child) -> None:
    """The worker's OpenMP arrangement for this machine (see kvgrid.cli.serve), logged."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env, line = worker_arrangement(config.device.num_threads, cores, os.environ)
    worker.env = {**(worker.env or {}), **env}
    _say(line)


def port_problems(net: cfg.NetworkConfig) -> list[str]:
    """One line per port that is 0 (serve must know its ports) or already taken where it will be bound (`net.host`
    for the frontend's, loopback for the others)."""
    problems = []
    seen: dict[int, str] = {}
    for f in dataclasses.fields(net):
        if not f.name.endswith("_port"):
            continue
        flag, port = "--" + f.name.replace("_", "-"), getattr(net, f.name)
        host = INTERNAL_HOST if f.name in INTERNAL_PORTS else net.host
        if port == 0:
            problems.append(f"{flag} 0 is not allowed here: `kvgrid serve` needs fixed ports")
        elif port in seen:
            problems.append(f"{flag} {port} is also given to {seen[port]}")
        elif not _port_free(host, port):
            problems.append(f"port {port} ({flag}) is already in use on {host}; free it or pass {flag} PORT")
        seen.setdefault(port, flag)
    return problems


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # gRPC servers bind with SO_REUSEADDR too, so a port in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if serve itself dies (Linux), so no service is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(child: Child) -> None:
    # A new session: a terminal's Ctrl-C reaches serve only, which then stops the children in order.
    env = {**os.environ, **child.env} if child.env else None
    child.process = subprocess.Popen(child.argv, start_new_session=True, preexec_fn=_die_with_parent, env=env)


def child_serving(child: Child) -> bool:
    return child.probe() if child.probe is not None else is_serving(child.grpc_addr)


def first_exited(children: list[Child]) -> Child | None:
    return next((c for c in children if c.process and c.process.poll() is not None), None)


def stop_all(children: list[Child], grace: float = 0.0) -> None:
    """Stop the children one at a time in reverse start order (frontend, scheduler, worker): SIGTERM, then up
    to ``grace`` (their --shutdown-grace) plus a margin to exit before SIGKILL. The frontend finishes its streams
    before the scheduler is told to stop, and the scheduler its requests before the worker is."""
    timeout = grace + STOP_MARGIN_SECONDS
    for child in reversed(children):
        if not child.process or child.process.poll() is not None:
            continue
        _say(f"stopping the {child.name} (pid {child.process.pid})")
        child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _say(f"the {child.name} did not stop within {timeout:g}s; killing it")
            child.process.kill()
            child.process.wait()


def _describe_exit(child: Child) -> str:
    code = child.process.returncode
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"the {child.name} {how}"


def kvgrid_command(executable: str | None = None, path: str | None = None, cwd: str | None = None) -> str:
    """`kvgrid` as the user's shell would run this installation: the bare name where PATH finds this very
    script (an activated virtualenv, a system install), else its path, relative to the working directory
    when under it (`.venv/bin/kvgrid` after `make serve` in a fresh shell). Defaults: this interpreter,
    $PATH, the working directory."""
    executable = executable or sys.executable
    path = os.environ.get("PATH", os.defpath) if path is None else path
    cwd = cwd or os.getcwd()
    # The console script sits beside the interpreter; in a virtualenv that is the environment's bin/,
    # which only activation (or the user) puts on PATH.
    script = os.path.join(os.path.dirname(executable), "kvgrid")
    found = shutil.which("kvgrid", path=path)
    if not os.path.isfile(script):  # started as `python -m kvgrid.cli` with no script installed beside it
        return "kvgrid" if found else f"{_shell_path(executable, cwd)} -m kvgrid.cli"
    if found and os.path.samefile(found, script):
        return "kvgrid"
    return _shell_path(script, cwd)


def _shell_path(path: str, cwd: str) -> str:
    relative = os.path.relpath(path, cwd)
    if relative.split(os.sep, 1)[0] == os.pardir:  # not under cwd
        return shlex.quote(os.path.abspath(path))
    return shlex.quote(relative if os.sep in relative else os.path.join(os.curdir, relative))


def print_ready(config: cfg.Config, children: list[Child]) -> None:
    net, security = config.network, config.security or cfg.SecurityConfig()
    host = dial_host(net.host)
    public = f"{host}:{net.tokenizer_port}"
    tls = bool(security.tls_cert_file)
    keyed = bool(security.api_key or security.api_key_file)
    guard = ", ".join(
        (["TLS" + (" with client certificates" if security.tls_ca_file else "")] if tls else [])
        + (["API key required"] if keyed else ["no API key"])
    )
    internal = "mutual TLS" if security.internal_tls_ca else "plaintext"
    _say(f"model {config.model.name} ({config.model.dtype})")
    _say(f"  public API   kvgrid.v1.TextGeneration  grpc{'s' if tls else ''}://{public}  ({guard}; reflection on)")
    http = f"http{'s' if tls else ''}://{host}:{net.http_port}"
    _say(f"  OpenAI API   {http}/v1  (base URL for OpenAI clients; /tokenize, /detokenize)")
    _say(f"  HTTP         {http}/health  {http}/metrics")
    for name, service, port in (("scheduler", "Scheduler", net.scheduler_port), ("worker", "Worker", net.worker_port)):
        _say(f"  {name:<12} kvgrid.v1.{service:<16}grpc://{INTERNAL_HOST}:{port}  (loopback only; {internal})")
    pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
    _say(f"ready ({pids}). Try:")
    ca = " --ca-file CA.pem" if tls else ""
    if keyed:
        print("    export KVGRID_API_KEY=...  # one of the keys given to --api-key, for the clients below", flush=True)
    print(f'    {kvgrid_command()} generate "What is the capital of France?" --addr {public}{ca}', flush=True)
    key_header = ' -H "authorization: Bearer $KVGRID_API_KEY"' if keyed else ""
    print(f"    grpcurl {'-cacert CA.pem' if tls else '-plaintext'}{key_header} {public} list", flush=True)
    body = '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
    curl_key = ' -H "Authorization: Bearer $KVGRID_API_KEY"' if keyed else ""
    curl_ca = " --cacert CA.pem" if tls else ""
    print(
        f"    curl{curl_ca} {http}/v1/chat/completions{curl_key} -H 'Content-Type: application/json' -d '{body}'",
        flush=True,
    )
    if tls:
        _say("CA.pem: the CA that signed --tls-cert-file")
    _say("Ctrl-C stops all three services")


class _Signals:
    """SIGINT/SIGTERM set a flag; the supervision loop polls it."""

    def __init__(self):
        self.received = threading.Event()
        self.name = ""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.name = signal.Signals(signum).name
        self.received.set()


def supervise(config: cfg.Config, children: list[Child], signals: _Signals) -> int:
    """Wait for health, announce readiness, then run until a signal (0) or a child's death (1)."""
    pending = list(children)
    announced_wait = time.monotonic()
    while pending:
        if signals.received.wait(POLL_SECONDS):
            _say(f"{signals.name} during start-up; stopping")
            return 1
        dead = first_exited(children)
        if dead:
            _say(f"start-up failed: {_describe_exit(dead)}; see its log above")
            return 1
        pending = [c for c in pending if not child_serving(c)]
        if pending and time.monotonic() - announced_wait > 15:
            _say("waiting for " + ", ".join(c.name for c in pending) + " to report SERVING")
            announced_wait = time.monotonic()
    print_ready(config, children)
    while True:
        if signals.received.wait(POLL_SECONDS):
            _say(f"{signals.name} received; draining the tokenizer, then stopping the scheduler and the worker")
            return 0
        if not restart_crashed(children, time.monotonic()):
            return 1


def restart_crashed(children: list[Child], now: float) -> bool:
    """Schedule a restart for each child that died, start those that are due; False when one crashed too often."""
    for child in children:
        if child.restart_at is None and child.process.poll() is not None:
            delay = child.restarts.crashed(now)
            if delay is None:
                policy = child.restarts
                _say(
                    f"{_describe_exit(child)}: {policy.num_recent} exits within {policy.window:g}s, "
                    "so it is not restarted again; stopping the stack (see its log above)"
                )
                return False
            _say(f"{_describe_exit(child)}; restarting it in {delay:g}s (see its log above)")
            child.restart_at = now + delay
        elif child.restart_at is not None and now >= child.restart_at:
            child.restart_at = None
            start(child)
            _say(f"restarted the {child.name} (pid {child.process.pid})")
    return True


def main(config: cfg.Config) -> int:
    problems = port_problems(config.network)
    if problems:
        for line in problems:
            print(f"kvgrid serve: {line}", file=sys.stderr)
        return 1
    config = child_config(config)
    try:
        children = build_children(config)
    except ValueError as e:  # an unreadable certificate file
        print(f"kvgrid serve: {e}", file=sys.stderr)
        return 1
    arrange_worker_threads(config, children[SERVICE_ORDER.index("worker")])
    signals = _Signals()
    _say(f"starting {', '.join(SERVICE_ORDER)} (pid {os.getpid()})")
    try:
        for child in children:
            start(child)
        code = supervise(config, children, signals)
    finally:
        stop_all(children, config.lifecycle.shutdown_grace)
    _say("stopped" if code == 0 else "stopped after an error")
    return code
