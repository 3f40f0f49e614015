"""The Redis tier's commands on the raw socket: MGET replies read straight into a buffer (RESP2 and RESP3 nulls,
replies that arrive a byte at a time, a buffer that fills up, an error reply, a connection closed halfway), SET NX
sent from the blocks' memory exactly as redis-py would pack it, and their replies; then loads and saves on a real
Redis that asks for a password (the pool's connection does the AUTH), reusing one receive buffer, and a user
refused MGET."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch

from services.worker.kv_transfer import layout
from services.worker.kv_transfer.raw_resp import Replies, ReplyError, send_sets
from services.worker.kv_transfer.redis_tier import Loaded, RedisTier
from tests.kv_tiers.redis_server import RedisServer
from tests.procs import free_port


class ChunkedSocket:
    """Hands out ``data`` ``chunk`` bytes per recv_into, then end of stream."""

    def __init__(self, data: bytes, chunk: int):
        self.data, self.chunk, self.at = data, chunk, 0

    def recv_into(self, view: memoryview) -> int:
        n = min(self.chunk, len(view), len(self.data) - self.at)
        view[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


VALUES = [b"a" * 300, b"", b"\r\n$3\r\nxyz\r\n" * 20, bytes(range(256)) * 3]
REPLY = b"*3\r\n" + bulk(VALUES[0]) + b"$-1\r\n" + bulk(VALUES[1]) + b"*3\r\n_\r\n" + bulk(VALUES[2]) + bulk(VALUES[3])
EXPECTED = [VALUES[0], None, VALUES[1], None, VALUES[2], VALUES[3]]


def read(data: bytes, chunk: int, buffer_bytes: int, counts=(3, 3)) -> tuple[list, list[int]]:
    allocated: list[int] = []

    def allocate(n: int) -> np.ndarray:
        allocated.append(n)
        return np.empty(n, np.uint8)

    values = list(Replies(ChunkedSocket(data, chunk), np.empty(buffer_bytes, np.uint8), allocate).mget(list(counts)))
    return [None if v is None else bytes(v) for v in values], allocated


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_values_and_nulls_of_both_protocols_come_back_in_order_however_the_bytes_arrive(chunk):
    values, allocated = read(REPLY, chunk, buffer_bytes=len(REPLY))
    assert values == EXPECTED
    assert allocated == []  # it all fit the buffer given


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_a_buffer_that_fills_up_carries_on_in_a_new_one_and_earlier_values_stay_intact(chunk):
    values, allocated = read(REPLY, chunk, buffer_bytes=400)
    assert values == EXPECTED
    assert allocated  # the 400 bytes held the first values only


def test_an_error_reply_and_a_reply_of_the_wrong_shape_raise():
    with pytest.raises(ReplyError, match="NOAUTH Authentication required"):
        read(b"-NOAUTH Authentication required.\r\n", 1 << 20, 64, counts=(1,))
    with pytest.raises(ReplyError, match="array of 2 values"):
        read(b"*1\r\n$1\r\nx\r\n", 1 << 20, 64, counts=(2,))
    with pytest.raises(ReplyError, match="bulk string"):
        read(b"*1\r\n:5\r\n", 1 << 20, 64, counts=(1,))


def test_a_connection_closed_in_the_middle_of_a_value_raises():
    with pytest.raises(ConnectionError, match="middle of a reply"):
        read(REPLY[:50], 1 << 20, 1024)


class SentBytes:
    def __init__(self):
        self.data = bytearray()

    def sendall(self, piece) -> None:
        self.data += memoryview(piece)


def test_sets_go_out_byte_for_byte_as_redis_py_packs_them():
    keys = ["kvgrid:kv:a", "kvgrid:kv:\u00e9t\u00e9", "k"]
    heads = [b"KVGRIDKV\x03\x00\x00\x00{}\r\n", b"", b"h"]
    payloads = [
        np.arange(700, dtype=np.uint8),
        memoryview(b"xyz"),
        torch.arange(6, dtype=torch.bfloat16).view(torch.uint8).numpy(),
    ]
    sent = SentBytes()
    send_sets(sent, keys, list(zip(heads, payloads, strict=True)))
    commands = [("SET", k, h + bytes(p), "NX") for k, h, p in zip(keys, heads, payloads, strict=True)]
    assert bytes(sent.data) == b"".join(redis.Connection().pack_commands(commands))


def test_set_replies_of_both_protocols_and_errors_are_all_read():
    replies = b"+OK\r\n$-1\r\n_\r\n-OOM command not allowed when used memory > 'maxmemory'.\r\n+OK\r\n"
    reader = Replies(ChunkedSocket(replies + b"*0\r\n", 3), np.empty(64, np.uint8), lambda n: np.empty(n, np.uint8))
    assert reader.set_errors(5) == ["OOM command not allowed when used memory > 'maxmemory'."]
    assert list(reader.mget([0])) == []  # the next reply is where it should be


def password_protected(redis_server, password: str):
    """A client of ``redis_server`` once it asks for ``password``, with the password in its URL."""
    redis_server.client().config_set("requirepass", password)
    return redis.Redis.from_url(redis_server.url.replace("redis://", f"redis://:{password}@"), socket_timeout=5)


SHAPE, DTYPE = (2, 2, 4, 1, 8), torch.bfloat16


def test_loads_through_a_password_protected_redis_reuse_one_receive_buffer(redis_server):
    client = password_protected(redis_server, "s3cret")
    tier = RedisTier(client, "ns", SHAPE, DTYPE)
    tier.start_prefault(40).join()  # more than the load below needs
    blocks = torch.randn((40, *SHAPE)).to(DTYPE)
    keys = [f"kvgrid:kv:{i}" for i in range(40)]
    tier.save(keys, blocks)
    tier.flush()
    buffers = []
    for _ in range(3):
        loaded = tier.load(keys)
        assert len(loaded.blocks) == 40
        assert all(torch.equal(got, want) for got, want in zip(loaded.blocks, blocks, strict=True))
        buffers.append(loaded.buffer)
        tier.release(loaded)
        assert loaded.buffer is None and loaded.blocks == []
    assert buffers[0] is buffers[1] is buffers[2]  # the prefaulted one, every time
    assert layout.decode(client.get(keys[3]), keys[3], "ns", SHAPE, DTYPE).equal(blocks[3])
    assert client.get("absent") is None and client.ping()  # the connection serves redis-py's own commands after


def test_an_error_reply_is_a_failed_load_and_the_next_load_on_the_pool_succeeds(redis_server):
    admin = redis_server.client()
    blocks = torch.randn((20, *SHAPE)).to(DTYPE)
    keys = [f"kvgrid:kv:{i}" for i in range(20)]  # two MGETs: the second's error is left unread on the socket
    saver = RedisTier(admin, "ns", SHAPE, DTYPE)
    saver.save(keys, blocks)
    saver.flush()
    admin.acl_setuser("loader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-mget"])
    failures: list[str] = []
    url = redis_server.url.replace("redis://", "redis://loader:pw@")
    tier = RedisTier(redis.Redis.from_url(url, socket_timeout=5), "ns", SHAPE, DTYPE, failures.append)
    assert tier.load(keys) == Loaded([]) and failures == ["load"]  # -NOPERM, read off the raw socket
    admin.acl_setuser("loader", enabled=True, commands=["+mget"])
    loaded = tier.load(keys)
    assert len(loaded.blocks) == 20 and all(torch.equal(a, b) for a, b in zip(loaded.blocks, blocks, strict=True))
    admin.rpush("kvgrid:kv:list", "x")  # MGET answers nil for a key of another type: a miss, not an error
    assert tier.load(["kvgrid:kv:list"]).blocks == [] and failures == ["load", "missing"]


def test_loads_and_saves_over_tls_take_the_clients_tls_connection(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    cert.private_key_pem.write_to_path(tmp_path / "key.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    tls = RedisServer(
        extra_args=[
            *("--tls-port", str(free_port()), "--tls-auth-clients", "no"),
            *("--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file", str(tmp_path / "key.pem")),
        ]
    ).start()
    try:
        tls_port = tls.extra_args[1]
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
        client = redis.Redis.from_url(url, socket_timeout=5)
        tier = RedisTier(client, "ns", SHAPE, DTYPE)
        blocks = torch.randn((20, *SHAPE)).to(DTYPE)
        keys = [f"kvgrid:kv:{i}" for i in range(20)]
        tier.save(keys, blocks)
        tier.flush()
        loaded = tier.load(keys)
        assert client.connection_pool.connection_class is redis.SSLConnection
        assert len(loaded.blocks) == 20 and all(torch.equal(a, b) for a, b in zip(loaded.blocks, blocks, strict=True))
    finally:
        tls.stop()
