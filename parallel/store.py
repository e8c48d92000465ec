"""Small JSON messages through torchrun's TCP store: step records, the running reward std, and
atomic fragment claims (`add` is atomic: docs/MODELS.md). Nothing here blocks a rank on a
collective, so generators can run ahead of trainers (TCSS)."""
from __future__ import annotations

import json
from datetime import timedelta

from parallel import torchapi


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
