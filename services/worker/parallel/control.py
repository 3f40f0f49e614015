"""The per-step control channel: rank 0 sends each step's batch to every other rank over TCP.

One connection per rank, opened by the rank (rank 0's address is the rendezvous host; the port is in the
store). A message is a length-prefixed pickle; ``None`` tells a rank to stop. Followers never write after
their hello, so on rank 0 a connection that turns readable has closed: that rank is gone. A rank reading
end-of-file knows rank 0 is gone. Not a collective: an idle worker waits on a socket, not on a timeout.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable

HEADER = struct.Struct("!Q")
HELLO = struct.Struct("!I")
CONNECT_TIMEOUT_S = 600.0


class ControlServer:
    """Rank 0's end: accepts one connection per rank, sends each message to all of them."""

    def __init__(self, host: str, num_ranks: int):
        self.num_ranks = num_ranks  # the other ranks: world size - 1
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.conns: dict[int, socket.socket] = {}
        self.ready = threading.Event()
        self.on_lost: Callable[[int], None] = lambda rank: None  # called on a watch thread when a rank's link closes
        self.closed = False
        threading.Thread(target=self._accept, name="kvgrid-control-accept", daemon=True).start()

    def _accept(self) -> None:
        while len(self.conns) < self.num_ranks:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                (rank,) = HELLO.unpack(_read_exact(conn, HELLO.size))
            except EOFError:
                conn.close()
                continue
            if rank in self.conns or not 0 < rank <= self.num_ranks:
                conn.close()  # a stray or duplicate rank: the group has it already
                continue
            self.conns[rank] = conn
            threading.Thread(
                target=self._watch, args=(rank, conn), name=f"kvgrid-control-rank{rank}", daemon=True
            ).start()
        self.listener.close()
        self.ready.set()

    def _watch(self, rank: int, conn: socket.socket) -> None:
        try:
            conn.recv(1)  # followers send nothing after the hello: this returns when the link closes
        except OSError:
            pass
        if not self.closed:
            self.on_lost(rank)

    def send(self, message) -> None:
        """To every rank; raises ConnectionError when one is gone. Waits for the ranks to connect first."""
        if not self.ready.wait(CONNECT_TIMEOUT_S):
            raise ConnectionError(f"only {len(self.conns)} of {self.num_ranks} ranks connected to the control channel")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = HEADER.pack(len(data)) + data
        for rank, conn in self.conns.items():
            try:
                conn.sendall(frame)
            except OSError as exc:
                raise ConnectionError(f"rank {rank} is gone ({exc})") from exc

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for conn in self.conns.values():
            conn.close()


class ControlClient:
    """A rank's end: ``recv`` gives the next message, raises EOFError once rank 0 is gone."""

    def __init__(self, host: str, port: int, rank: int, timeout: float = CONNECT_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(HELLO.pack(rank))

    def recv(self):
        (size,) = HEADER.unpack(_read_exact(self.sock, HEADER.size))
        return pickle.loads(_read_exact(self.sock, size))  # noqa: S301 - rank 0 of this group is the only sender

    def close(self) -> None:
        self.sock.close()


def _read_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except OSError as exc:
            raise EOFError(str(exc)) from exc
        if n == 0:
            raise EOFError("the control channel closed")
        got += n
    return bytes(buf)
