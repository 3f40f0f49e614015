"""The Redis tier's bulk commands on the socket of a redis-py connection: values sent from and read into buffers.

A prompt's KV blocks are tens of MB. redis-py packs a command by joining its arguments (a copy of every value),
and with hiredis reads a reply in 64 KiB pieces, copies each into the parser, then every value into a bytes
object of its own: two or three passes over the bytes, and fresh pages for each big bytes object. Here the
tier takes a connection from the client's own pool (so AUTH, SELECT, TLS and timeouts stay the client's),
sends ``SET NX`` commands as the key's line, the value's header and the block's own memory (``send_sets``),
and reads ``MGET`` replies with ``recv_into`` straight into a buffer it keeps (``Replies``): the kernel's copy
and nothing else. Replies are RESP2 or RESP3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

MAX_LINE = 4096  # a reply's type line: "*16", "$368840", "+OK", "_", or an error's message

Buffer = bytes | memoryview


class ReplyError(Exception):
    """Redis answered with an error, or with something the command does not answer."""


def send_sets(sock, keys: Sequence[str], values: Sequence[tuple[bytes, Buffer]]) -> None:
    """``SET key value NX`` for each key, a value given as its head and its payload: the payload is sent from its
    own memory, never joined to anything."""
    tail = b""
    for key, (header, payload) in zip(keys, values, strict=True):
        encoded = key.encode()
        length = len(header) + memoryview(payload).nbytes
        sock.sendall(b"%s*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (tail, len(encoded), encoded, length, header))
        sock.sendall(payload)
        tail = b"\r\n$2\r\nNX\r\n"
    if tail:
        sock.sendall(tail)


Allocate = Callable[[int], np.ndarray]


class Replies:
    """Reads replies from ``sock`` into ``buffer``; where it fills up, into a new one of at least the size
    asked of ``allocate`` (values read before stay where they are: their views keep that buffer alive)."""

    def __init__(self, sock, buffer: np.ndarray, allocate: Allocate):
        self.sock = sock
        self.allocate = allocate
        self._use(buffer)

    def _use(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.pos = 0  # the first byte not parsed yet
        self.filled = 0  # the first byte not received yet

    def mget(self, counts: list[int]) -> Iterator[memoryview | None]:
        """The values of MGET replies of ``counts`` keys each, in order, each as soon as it is in (None for a key
        Redis does not hold)."""
        for count in counts:
            kind, rest = self._line()
            if kind != b"*" or int(rest) != count:
                raise ReplyError(f"expected an array of {count} values, got {(kind + rest)[:80]!r}")
            for _ in range(count):
                yield self._value()

    def set_errors(self, count: int) -> list[str]:
        """The errors among ``count`` SET NX replies (``+OK``, or a null where the key was there already); all are
        read, so the connection stays in step."""
        errors = []
        for _ in range(count):
            try:
                kind, rest = self._line()
            except ReplyError as exc:
                errors.append(str(exc))
                continue
            if not (kind == b"+" or kind == b"_" or (kind == b"$" and rest == b"-1")):
                raise ReplyError(f"expected a SET reply, got {(kind + rest)[:80]!r}")
        return errors

    def _value(self) -> memoryview | None:
        kind, rest = self._line()
        if kind == b"_" or (kind == b"$" and rest == b"-1"):
            return None
        if kind != b"$":
            raise ReplyError(f"expected a bulk string, got {(kind + rest)[:80]!r}")
        length = int(rest)
        self._receive(length + 2)
        value = self.view[self.pos : self.pos + length]
        self.pos += length + 2  # and its CRLF
        return value

    def _line(self) -> tuple[bytes, bytes]:
        """The next reply line's type byte and the rest; raises ReplyError for an error reply (consumed)."""
        while True:
            window = bytes(self.view[self.pos : min(self.filled, self.pos + MAX_LINE)])
            end = window.find(b"\r\n")
            if end >= 0:
                break
            if len(window) >= MAX_LINE:
                raise ReplyError(f"reply line longer than {MAX_LINE} bytes")
            self._receive(len(window) + 1)
        self.pos += end + 2
        kind, rest = window[:1], window[1:end]
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        return kind, rest

    def _receive(self, nbytes: int) -> None:
        """Until ``nbytes`` past ``pos`` are in the buffer."""
        end = self.pos + nbytes
        if end > len(self.buffer):  # carry what is not parsed yet over to a new buffer
            unread = self.buffer[self.pos : self.filled]
            buffer = self.allocate(max(nbytes, 1 << 16))
            buffer[: len(unread)] = unread
            self._use(buffer)
            self.filled = len(unread)
            end = nbytes
        while self.filled < end:
            got = self.sock.recv_into(self.view[self.filled :])
            if not got:
                raise ConnectionError("redis closed the connection in the middle of a reply")
            self.filled += got
