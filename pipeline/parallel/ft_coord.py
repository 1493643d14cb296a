"""The job's coordinator: the lighthouse that forms quorums and the store that holds the record.

In place of torchft's lighthouse (a Rust gRPC server that forms a quorum from whoever asks,
with a dashboard that lists the replicas and ends any of them on request), one server per job
(ft_wire: mutual TLS under the job's certificate; only the job's processes are served) answers:

- `quorum`: a replica group's manager joins the next quorum and waits for it. The rule is
  torchft's: the participants whose heartbeats are fresh; at once when every member of the
  previous quorum is back (a fast quorum); else at least `min_replicas`, and every heartbeating
  replica joined or `join_timeout` passed since the first joined (torchft 0.2's rule: the
  job's record, not the quorum, keeps two lone groups from committing two histories). The
  quorum's id grows when its members change.
- `heartbeat`: a group is alive (a quorum request counts as one).
- `set`, `get`, `check`, `add`, `compare_set`, `delete`: the job's record (ft_record), with
  the semantics of torch's TCPStore, which it replaces (any local user could write there).

There is no dashboard and no kill request: the launcher ends groups itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from pipeline.parallel.ft_auth import host_port
from pipeline.parallel.ft_tls import JobTLS
from pipeline.parallel.ft_wire import Client, Server, expect

__all__ = ["KeyStore", "Lighthouse", "StoreClient", "address", "lighthouse_hostport",
           "serve_coordinator"]

_TICK_S = 0.1  # how often a quorum is looked for while groups wait (torchft: 100 ms)


class KeyStore:
    """Keys to values (text) with torch's TCPStore semantics, in this process."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = value.decode() if isinstance(value, bytes) else str(value)
            self._changed.notify_all()

    def get(self, key: str, timeout: float = 300.0) -> bytes:
        """The value, waiting up to `timeout` for the key to be set."""
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._data, timeout):
                raise TimeoutError(f"key {key!r} was not set within {timeout:g}s")
            return self._data[key].encode()

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, "0")) + int(amount)
            self._data[key] = str(value)
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set `desired` where the key holds `expected` (or is missing and `expected` is
        empty); the value it holds after, as TCPStore answers."""
        expected = expected.decode() if isinstance(expected, bytes) else expected
        desired = desired.decode() if isinstance(desired, bytes) else desired
        with self._changed:
            held = self._data.get(key)
            if held is None and expected != "":
                return expected.encode()
            if held is None or held == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired.encode()
            return held.encode()

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None


class Lighthouse:
    """torchft's quorum rule over the members that asked (see the module's docstring)."""

    def __init__(self, *, min_replicas: int = 1, join_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 5.0) -> None:
        self.min_replicas, self.join_timeout_s = min_replicas, join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._state = threading.Condition()
        self._joined: dict[str, tuple[float, dict[str, Any]]] = {}  # id: (when, member)
        self._beats: dict[str, float] = {}
        self._previous: dict[str, Any] | None = None
        self._quorum_id = 0

    def heartbeat(self, replica_id: str) -> None:
        with self._state:
            self._beats[replica_id] = time.monotonic()

    def quorum(self, member: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The first quorum formed from now on that holds `member` (its id, its members)."""
        rid = str(member["replica_id"])
        deadline = time.monotonic() + timeout
        with self._state:
            self._join(rid, member)
            seen = self._previous
            while True:
                self._tick()
                latest = self._previous
                if latest is not seen and latest is not None:
                    seen = latest
                    if any(p["replica_id"] == rid for p in latest["participants"]):
                        return latest
                    self._join(rid, member)  # formed without it: it asks for the next
                left = deadline - time.monotonic()
                if left <= 0:
                    self._joined.pop(rid, None)
                    raise TimeoutError(f"no quorum formed within {timeout:g}s")
                self._state.wait(min(left, _TICK_S))

    def _join(self, rid: str, member: dict[str, Any]) -> None:
        now = time.monotonic()
        self._beats[rid] = now  # a request is a heartbeat too
        self._joined[rid] = (now, member)

    def _tick(self) -> None:
        """Form a quorum if the rule allows (under the lock)."""
        members = self._ready(time.monotonic())
        if members is None:
            return
        ids = [m["replica_id"] for m in members]
        if self._previous is None or ids != [p["replica_id"]
                                             for p in self._previous["participants"]]:
            self._quorum_id += 1
        self._previous = {"quorum_id": self._quorum_id, "participants": members}
        self._joined.clear()
        self._state.notify_all()

    def _ready(self, now: float) -> list[dict[str, Any]] | None:
        healthy = {r for r, t in self._beats.items() if now - t < self.heartbeat_timeout_s}
        joined = {r: v for r, v in self._joined.items() if r in healthy}
        members = [v[1] for _, v in sorted(joined.items())]
        if not joined:
            return None
        if self._previous is not None:
            before = {p["replica_id"] for p in self._previous["participants"]}
            if any(v[1].get("shrink_only") for v in joined.values()):
                members = [m for m in members if m["replica_id"] in before]
            if before <= joined.keys():  # every member of the last quorum is back
                return members
        if len(joined) < self.min_replicas:
            return None
        first = min(t for t, _ in joined.values())
        if len(joined) < len(healthy) and now - first < self.join_timeout_s:
            return None  # a heartbeating group may still join
        return members


_OPS = frozenset({"quorum", "heartbeat", "set", "get", "check", "add", "compare_set", "delete"})


def _coordinator(lighthouse: Lighthouse, store: KeyStore) -> Any:
    """The server's handler: one request to its answer."""

    def handle(request: dict[str, Any]) -> Any:
        op = expect(request, "op", str)
        if op not in _OPS:
            raise ValueError(f"no operation {ascii(op)[:80]}; the operations: {sorted(_OPS)}")
        if op == "quorum":
            member = expect(request, "member", dict)
            expect(member, "replica_id", str)
            return lighthouse.quorum(member, expect(request, "timeout", float))
        if op == "heartbeat":
            lighthouse.heartbeat(expect(request, "replica_id", str))
            return None
        if op == "check":
            keys = expect(request, "keys", list)
            return store.check([expect({"keys": k}, "keys", str) for k in keys])
        key = expect(request, "key", str)
        if op == "set":
            store.set(key, expect(request, "value", str))
            return None
        if op == "get":
            return store.get(key, expect(request, "timeout", float)).decode()
        if op == "add":
            return store.add(key, expect(request, "amount", int))
        if op == "compare_set":
            return store.compare_set(key, expect(request, "expected", str),
                                     expect(request, "desired", str)).decode()
        return store.delete_key(key)  # "delete"

    return handle


@contextmanager
def serve_coordinator(*, host: str = "127.0.0.1", port: int = 0, min_replicas: int = 1,
                      join_timeout_s: float = 60.0, heartbeat_timeout_s: float = 5.0,
                      tls: JobTLS | None = None
                      ) -> Iterator[tuple[Server, Lighthouse, KeyStore]]:
    """The job's coordinator served on `host`:`port` (0: any free port) until the block
    ends; `tls` defaults to `PIPELINE_FT_CERT`'s."""
    lighthouse = Lighthouse(min_replicas=min_replicas, join_timeout_s=join_timeout_s,
                            heartbeat_timeout_s=heartbeat_timeout_s)
    store = KeyStore()
    server = Server(_coordinator(lighthouse, store),
                    tls=tls, host=host, port=port,
                    name="pipeline-ft-lighthouse")
    try:
        yield server, lighthouse, store
    finally:
        server.close()


def address(server: Server) -> str:
    """The lighthouse address ranks are given (TORCHFT_LIGHTHOUSE)."""
    return f"http://{host_port(server.host, server.port)}"


class StoreClient:
    """The job's record in the coordinator at `host`:`port`, as a TCPStore client (the
    methods ft_record calls)."""

    def __init__(self, host: str, port: int, timeout: float,
                 tls: JobTLS | None = None) -> None:
        self._timeout = timeout
        self._client = Client(host, port, connect_timeout=timeout, tls=tls)

    def _call(self, op: str, **fields: Any) -> Any:
        return self._client.call({"op": op, **fields}, self._timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key=key, value=value.decode() if isinstance(value, bytes) else value)

    def get(self, key: str) -> bytes:
        return str(self._call("get", key=key, timeout=self._timeout)).encode()

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=list(keys)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return str(self._call("compare_set", key=key, expected=expected,
                              desired=desired)).encode()

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key=key))

    def close(self) -> None:
        self._client.close()


def lighthouse_hostport(addr: str | None = None) -> tuple[str, int]:
    """(host, port) of a lighthouse address (`http://host:port`, or TORCHFT_LIGHTHOUSE)."""
    parts = urlsplit(addr if addr is not None else os.environ["TORCHFT_LIGHTHOUSE"])
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"a lighthouse address is http://host:port; got {addr!r}")
    return parts.hostname, parts.port
