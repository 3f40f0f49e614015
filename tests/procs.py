"""Process helpers shared by the suites that start real services: free ports and a clean stop."""

from __future__ import annotations

import random
import signal
import socket
import subprocess

# Ports handed out are drawn from below the kernel's ephemeral range. A port from bind(0) comes from that range,
# where every outgoing connection (a scheduler dialing its worker, a health check) takes its local port too: one of
# them could take the port before the service it was chosen for binds it, which then fails to start ("Address
# already in use") while the test waits for it.
LOWEST_PORT = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_EPHEMERAL_START = _ephemeral_start()
_handed_out: set[int] = set()


def free_ports(n: int) -> list[int]:
    """n distinct local ports that were free a moment ago, outside the ephemeral range and never handed out before
    in this process (bound together so none repeats)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            # a range set to start low leaves no room below it: take what the kernel gives (port 0)
            port = 0 if _EPHEMERAL_START - LOWEST_PORT < 1000 else random.randrange(LOWEST_PORT, _EPHEMERAL_START)
            if port in _handed_out:
                continue
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        ports = [sock.getsockname()[1] for sock in socks]
        _handed_out.update(ports)
        return ports
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def terminate(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM and wait; SIGKILL after ``timeout`` seconds. Returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


TCP_LISTEN = "0A"  # the st column of /proc/net/tcp for a listening socket


def listeners(port: int) -> int:
    """How many listening TCP sockets the kernel holds on ``port`` (Linux /proc/net), whichever process holds
    them. A killed process's socket counts until it is really closed: its /proc/<pid>/fd may already read empty
    while the process's other threads still hold it (and it still takes connections, which its close resets)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    cols = line.split()
                    count += cols[3] == TCP_LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port
        except FileNotFoundError:
            continue
    return count
