"""Where the ranks of one worker group meet: a torch TCPStore that rank 0 serves at the rendezvous address.

Rank 0 publishes what every rank needs in the store (the rank plan, pickled, and the port of its control
channel), so a rank started elsewhere needs only the rendezvous address and its node's index; then every
rank joins the process group through the same store. Like torch.distributed itself the store is
unauthenticated: the rendezvous port belongs on the group's private network.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re

import torch.distributed as dist

from services.common.config import Config

PLAN_KEY = "kvgrid/plan"
CONTROL_KEY = "kvgrid/control_port"
DEFAULT_MASTER_PORT = 29500
# How long a rank waits for rank 0's store (rank 0 may be restarting) and for the others to join.
JOIN_TIMEOUT = datetime.timedelta(minutes=10)


def init_address(config: Config) -> tuple[str, int] | None:
    """(host, port) of ``--distributed-init-method tcp://HOST:PORT``, else of MASTER_ADDR/MASTER_PORT (torchrun's
    variables, port 29500 by default); None when neither is set (a one-node group picks a free local port)."""
    method = config.parallel.distributed_init_method if config.parallel is not None else ""
    if method:
        m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", method)
        return m.group(1), int(m.group(2))
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT") or DEFAULT_MASTER_PORT)
    return None


def serve_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    """Rank 0's store (listening on every interface; ``port`` 0 picks a free one, see ``store.port``)."""
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False)


def join_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    """A client of rank 0's store; waits up to JOIN_TIMEOUT for it to listen."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=JOIN_TIMEOUT)


def publish(store: dist.TCPStore, plan, control_port: int) -> None:
    store.set(CONTROL_KEY, str(control_port))
    store.set(PLAN_KEY, pickle.dumps(plan))


def read_plan(store: dist.TCPStore):
    """The rank plan rank 0 published (blocks until it has)."""
    return pickle.loads(store.get(PLAN_KEY))  # noqa: S301 - rank 0 wrote it; the store is the group's own


def control_port(store: dist.TCPStore) -> int:
    return int(store.get(CONTROL_KEY))
