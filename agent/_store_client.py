"""A worker's connection to the job's store that survives the store pod being replaced.

The store pod (`store_host`) is re-created by the operator when it dies (a kubelet restarts it in place when
it crashes). A plain `TCPStore` client fails every call from then on, and the worker with it: every worker of
the job at once, which is the whole job. `ReconnectingStore` is a `torch.distributed.Store` (so that
`PrefixStore` and gloo's rendezvous use it like any store) that forwards every call to a `TCPStore` client
and, when the connection is lost (`DistNetworkError`; a timeout waiting for a key is not a lost connection
and is raised as before), looks the store's address up again (the Redis key the new host registers, or
`RJOB_STORE_ADDR`) and retries the call on a new connection, with capped backoff, for up to `give_up_s`.

What the new store holds: the new host republishes the committed plan from Redis and seeds the failure
counter with the count it keeps in Redis (`store_host`), before it registers its address; the workers keep
training on the process groups they have (gloo does not use the store after its rendezvous), rank 0 rewrites
`committed` at its next step, and a commit vote lost with the old store is cast again by the retried call.
The per-step records of the old store (losses, sample ids, events) are gone with it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed import DistNetworkError

CONNECT_S = 2.0
"""How long one attempt to connect to a (new) store waits."""


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store: expected host:port, got {address!r}")
    return host, int(port)


def address_from_pod_env(environ: dict[str, str] | None = None) -> Callable[[], str | None]:
    """How a worker of a pod finds the store's current address: `RJOB_STORE_ADDR`, or the Redis key the
    store host registers (None while Redis is away or the key is missing)."""
    env = dict(os.environ if environ is None else environ)
    fixed = env.get("RJOB_STORE_ADDR")
    if fixed:
        return lambda: fixed
    url, job = env.get("RJOB_REDIS_URL"), env.get("RJOB_JOB")
    if not url or not job:
        return lambda: None
    import redis
    from redis.exceptions import RedisError

    from resilientjob.protocol.keys import JobKeys

    key = JobKeys(env.get("RJOB_NAMESPACE", "default"), job).store
    client = redis.Redis.from_url(
        url, password=env.get("RJOB_REDIS_PASSWORD") or None, socket_connect_timeout=2.0, socket_timeout=2.0
    )

    def resolve() -> str | None:
        try:
            raw = client.get(key)
        except (RedisError, OSError):
            return None
        if not raw:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    return resolve


def _listening(address: str) -> bool:
    """Whether something accepts connections at `address`: a plain socket's quiet check before a `TCPStore`
    client is made there. A client that cannot connect retries for `CONNECT_S` and logs every try with a C++
    stack trace (about 45 lines a try in a worker's log while the store pod is replaced)."""
    try:
        with socket.create_connection(split_address(address), timeout=CONNECT_S):
            return True
    except OSError:
        return False


class ReconnectingStore(Store):
    """A `TCPStore` client that reconnects to the store's current address when its connection is lost."""

    def __init__(
        self,
        address: str,
        resolve: Callable[[], str | None],
        timeout: timedelta,
        give_up_s: float,
    ) -> None:
        super().__init__()
        if give_up_s <= 0:
            raise ValueError(f"give_up_s: must be > 0, got {give_up_s}")
        self.address = address
        self._resolve = resolve
        self._timeout = timeout
        self._give_up_s = give_up_s
        self._lock = threading.Lock()
        self._store = TCPStore(*split_address(address), is_master=False, timeout=timeout)
        self.reconnects = 0

    def _reconnect(self, broken: TCPStore) -> None:
        with self._lock:
            if self._store is not broken:
                return  # another thread reconnected meanwhile
            print(f"store: lost the job's store at {self.address}; reconnecting", flush=True)
            started = time.monotonic()
            delay = 0.05
            while True:
                address = self._resolve() or self.address
                try:
                    if not _listening(address):
                        raise DistNetworkError(f"nothing listens at {address}")
                    store = TCPStore(
                        *split_address(address), is_master=False, timeout=timedelta(seconds=CONNECT_S)
                    )
                    store.set_timeout(self._timeout)
                except DistNetworkError:
                    if time.monotonic() - started > self._give_up_s:
                        raise
                    time.sleep(delay)
                    delay = min(1.0, delay * 2)
                    continue
                self._store, self.address = store, address
                self.reconnects += 1
                print(f"store: reconnected to {address} after {time.monotonic() - started:.1f} s", flush=True)
                return

    def _call(self, name: str, *args: Any) -> Any:
        while True:
            store = self._store
            try:
                return getattr(store, name)(*args)
            except DistNetworkError:
                self._reconnect(store)

    # ---- the Store interface ----------------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        result: bytes = self._call("get", key)
        return result

    def add(self, key: str, amount: int) -> int:
        result: int = self._call("add", key, amount)
        return result

    def check(self, keys: list[str]) -> bool:
        result: bool = self._call("check", keys)
        return result

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        result: bytes = self._call("compare_set", key, expected, desired)
        return result

    def append(self, key: str, value: Any) -> None:
        self._call("append", key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._call("wait", keys)
        else:
            self._call("wait", keys, timeout)

    def delete_key(self, key: str) -> bool:
        result: bool = self._call("delete_key", key)
        return result

    def num_keys(self) -> int:
        result: int = self._call("num_keys")
        return result

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._call("set_timeout", timeout)
