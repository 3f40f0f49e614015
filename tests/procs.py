"""Process helpers shared by the suites that start real services: free ports and a clean stop."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_ports(n: int) -> list[int]:
    """n distinct local ports that were free a moment ago (bound together so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
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
