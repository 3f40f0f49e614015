"""`kvgrid serve`: the three services as child processes on one machine, supervised together.

The worker, scheduler and tokenizer start at once (the scheduler dials the worker
with backoff, the frontend waits for the scheduler), each with its own flags from
the shared configuration. `serve` waits until every gRPC health check answers
SERVING, prints the endpoints, and then stays in the foreground. A child that
dies after that is restarted with backoff (a worker's requests wait for it in the
scheduler); one that keeps dying (see ``RestartPolicy``) stops the stack with exit
code 1, as does any child dying during start-up. Ctrl-C or SIGTERM drains in
order: the frontend first (its streams finish within --shutdown-grace), then the
scheduler, then the worker. With ``--api-server-count N`` the frontend is N processes
sharing the public ports; each is a child of its own (restarted alone), and they drain
together (``kvgrid.cli.supervision``).

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
import functools
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping

from kvgrid.cli.probes import INTERNAL_SERVICES, PUBLIC_SERVICE, listens, readiness_probe
from kvgrid.cli.supervision import (
    Child,
    Signals,
    child_serving,
    describe_exit,
    first_exited,
    restart_crashed,
    say,
    start,
    stop_all,
)
from services.common import config as cfg
from services.common.cpu_quota import usable_cores
from services.common.metrics import MULTIPROC_DIR

# Order of start-up and of the summary; shutdown runs in reverse (frontend first).
SERVICE_ORDER = ("worker", "scheduler", "tokenizer")
# The services only the frontend calls (INTERNAL_SERVICES) listen on loopback, whatever --host is.
INTERNAL_HOST = "127.0.0.1"
INTERNAL_PORTS = ("scheduler_port", "scheduler_metrics_port", "worker_port", "worker_metrics_port")
POLL_SECONDS = 0.5

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
    """Worker, scheduler, then the frontend, or ``--api-server-count`` frontends named tokenizer-1, tokenizer-2, …"""
    net = config.network
    public = f"{dial_host(net.host)}:{net.tokenizer_port}"
    addrs = {
        "worker": f"{INTERNAL_HOST}:{net.worker_port}",
        "scheduler": f"{INTERNAL_HOST}:{net.scheduler_port}",
        "tokenizer": public,
    }
    http_addr = (dial_host(net.host).strip("[]"), net.http_port)
    num_frontends = config.http.api_server_count if config.http is not None else 1
    children = node_children(config)
    for name in SERVICE_ORDER:
        argv, env = service_argv(name, config), service_env(name, config)
        probe = readiness_probe(name, config.security, addrs[name], http_addr)
        if name != PUBLIC_SERVICE or num_frontends == 1:
            children.append(Child(name, argv, addrs[name], env=env, probe=probe))
            continue
        for i in range(1, num_frontends + 1):
            frontend = Child(f"{name}-{i}", argv, addrs[name], env=dict(env), stage=name)
            # Each of them listens only once it serves (services.tokenizer.server), and a connection to the shared
            # ports reaches any of them: so ask the process itself whether it listens.
            frontend.probe = functools.partial(_frontend_listens, frontend, (net.tokenizer_port, net.http_port))
            children.append(frontend)
    return children


def node_children(config: cfg.Config) -> list[Child]:
    """With ``--nnodes N``: ``kvgrid worker-rank`` for nodes 1..N-1, each given only the rendezvous address and
    its index, as separate machines would be (here all on this one). They start first so that they stop last:
    the worker (rank 0) stops them in order when it stops."""
    parallel, children = config.parallel, []
    logs = cfg.to_flags(config.observability)
    for node in range(1, parallel.nnodes):
        argv = [sys.executable, "-m", "kvgrid.cli", "worker-rank", "--node-rank", str(node)]
        argv += ["--distributed-init-method", parallel.distributed_init_method, *logs]
        children.append(Child(f"worker-rank-{node}", argv, "", probe=lambda: True, stage="worker-rank"))
    return children


def with_rendezvous(config: cfg.Config) -> cfg.Config:
    """Several nodes on this machine: a rendezvous on a free loopback port unless one is given."""
    parallel = config.parallel
    if parallel.nnodes == 1 or parallel.distributed_init_method:
        return config
    with socket.socket() as sock:
        sock.bind((INTERNAL_HOST, 0))
        port = sock.getsockname()[1]
    method = f"tcp://{INTERNAL_HOST}:{port}"
    return dataclasses.replace(config, parallel=dataclasses.replace(parallel, distributed_init_method=method))


def _frontend_listens(child: Child, ports: tuple[int, int]) -> bool:
    return child.process is not None and listens(child.process.pid, ports)


def share_frontend_metrics(children: list[Child], environ: Mapping[str, str] = os.environ) -> str:
    """Several frontends: one /metrics answer for all of them, whichever answers the scrape (prometheus-client's
    multiprocess mode, in ``PROMETHEUS_MULTIPROC_DIR``: the user's, or a fresh directory). Returns the directory
    serve made and must remove, or ""."""
    frontends = [c for c in children if c.stage == PUBLIC_SERVICE]
    if len(frontends) < 2:
        return ""
    made = "" if environ.get(MULTIPROC_DIR) else tempfile.mkdtemp(prefix="kvgrid-frontend-metrics-")
    directory = made or environ[MULTIPROC_DIR]
    for child in frontends:
        child.env = {**(child.env or {}), MULTIPROC_DIR: directory}
    say(f"{len(frontends)} frontends share the public ports; their /metrics sums them all (files in {directory})")
    return made


def arrange_worker_threads(config: cfg.Config, worker: Child) -> None:
    """The worker's OpenMP arrangement for this machine (see kvgrid.cli.serve), logged: the cores counted are those
    this process may run on, no more than whole cores of its cgroup's CPU quota."""
    env, line = worker_arrangement(config.device.num_threads, usable_cores(), os.environ)
    worker.env = {**(worker.env or {}), **env}
    say(line)


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
    say(f"model {config.model.name} ({config.model.dtype})")
    say(f"  public API   kvgrid.v1.TextGeneration  grpc{'s' if tls else ''}://{public}  ({guard}; reflection on)")
    http = f"http{'s' if tls else ''}://{host}:{net.http_port}"
    say(f"  OpenAI API   {http}/v1  (base URL for OpenAI clients; /tokenize, /detokenize)")
    say(f"  HTTP         {http}/health  {http}/metrics")
    for name, service, port in (("scheduler", "Scheduler", net.scheduler_port), ("worker", "Worker", net.worker_port)):
        say(f"  {name:<12} kvgrid.v1.{service:<16}grpc://{INTERNAL_HOST}:{port}  (loopback only; {internal})")
    pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
    say(f"ready ({pids}). Try:")
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
        say("CA.pem: the CA that signed --tls-cert-file")
    say("Ctrl-C stops all three services")


def supervise(config: cfg.Config, children: list[Child], signals: Signals) -> int:
    """Wait for health, announce readiness, then run until a signal (0) or a child's death (1)."""
    pending = list(children)
    announced_wait = time.monotonic()
    while pending:
        if signals.received.wait(POLL_SECONDS):
            say(f"{signals.name} during start-up; stopping")
            return 1
        dead = first_exited(children)
        if dead:
            say(f"start-up failed: {describe_exit(dead)}; see its log above")
            return 1
        pending = [c for c in pending if not child_serving(c)]
        if pending and time.monotonic() - announced_wait > 15:
            say("waiting for " + ", ".join(c.name for c in pending) + " to report SERVING")
            announced_wait = time.monotonic()
    print_ready(config, children)
    while True:
        if signals.received.wait(POLL_SECONDS):
            say(f"{signals.name} received; draining the frontend, then stopping the scheduler and the worker")
            return 0
        if not restart_crashed(children, time.monotonic()):
            return 1


def main(config: cfg.Config) -> int:
    problems = port_problems(config.network)
    if problems:
        for line in problems:
            print(f"kvgrid serve: {line}", file=sys.stderr)
        return 1
    config = with_rendezvous(child_config(config))
    try:
        children = build_children(config)
    except ValueError as e:  # an unreadable certificate file
        print(f"kvgrid serve: {e}", file=sys.stderr)
        return 1
    arrange_worker_threads(config, next(c for c in children if c.name == "worker"))
    metrics_dir = share_frontend_metrics(children)
    signals = Signals()
    say(f"starting {', '.join(c.name for c in children)} (pid {os.getpid()})")
    try:
        for child in children:
            start(child)
        code = supervise(config, children, signals)
    finally:
        stop_all(children, config.lifecycle.shutdown_grace)
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    say("stopped" if code == 0 else "stopped after an error")
    return code
