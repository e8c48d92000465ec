"""Small JSON messages through torchrun's TCP store: step records, the running reward std, and
atomic fragment claims (`add` is atomic: docs/MODELS.md). Nothing here blocks a rank on a
collective, so generators can run ahead of trainers (TCSS)."""
from __future__ import annotations

import json
import os
import uuid
from datetime import timedelta

from torch.distributed import TCPStore

from parallel import torchapi

LAUNCH_KEY = "digenrl/launch-id"
_LAUNCH_STORE: list[TCPStore] = []  # rank 0's early server (no agent store): init_process_group shares it


def launch_id(timeout_s: float = 300.0) -> str:
    """This launch's own id, the same on every rank of it and on no other launch (the run folder's
    lock tells its own launch from others by it: checkpointing/lock.py). Every rank proposes a
    random id and the rendezvous store keeps the first (compare_set is atomic), so no rank waits
    for another: torchrun's agent hosts the store before any worker starts. Never the launcher's
    rdzv id, which every launch of a SLURM allocation shares. Without an agent store rank 0 starts
    the store's server now, as init_process_group would (multi-tenant: it later shares it); one
    process without a launcher draws its own."""
    mine = uuid.uuid4().hex
    if "MASTER_PORT" not in os.environ:
        return mine
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                     is_master=rank == 0 and not agent, timeout=timedelta(seconds=timeout_s),
                     wait_for_workers=False, multi_tenant=not agent)
    if rank == 0 and not agent:
        _LAUNCH_STORE.append(store)  # the server lives on for init_process_group
    return store.compare_set(LAUNCH_KEY, "", mine).decode()


class StepStore:
    def __init__(self, timeout_s: float, prefix: str = "digenrl"):
        # torchrun's store, which init_process_group connected to: torch names no public getter
        self.store = torchapi.require("the run's step store (parallel/store.py)",
                                      "torch.distributed.distributed_c10d._get_default_store")()
        self.store.set_timeout(timedelta(seconds=timeout_s))
        self.prefix = prefix

    def clone(self) -> "StepStore":
        """The same keys over a connection of its own: a blocking get on one connection holds its
        lock until it returns, so a heartbeat thread needs its own."""
        other = object.__new__(StepStore)
        other.store, other.prefix = self.store.clone(), self.prefix
        return other

    def set_timeout(self, timeout_s: float) -> None:
        self.store.set_timeout(timedelta(seconds=timeout_s))

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def put(self, key: str, obj) -> None:
        self.store.set(self._k(key), json.dumps(obj))

    def get(self, key: str):
        """Blocks until the key exists (up to the timeout)."""
        return json.loads(self.store.get(self._k(key)))

    def ready(self, key: str) -> bool:
        return self.store.check([self._k(key)])

    def delete(self, key: str) -> None:
        self.store.delete_key(self._k(key))

    def add(self, key: str, amount: int = 1) -> int:
        """Atomic: the counter's value after adding."""
        return int(self.store.add(self._k(key), amount))

    def get_if_set(self, key: str):
        """The value, or None when the key is not set (never blocks)."""
        return self.get(key) if self.ready(key) else None
