"""The job's coordinator: the lighthouse that forms quorums and the store that holds the record.

In place of torchft's lighthouse (a Rust gRPC server that forms a quorum from whoever asks,
with a dashboard that lists the replicas and ends any of them on request), one server per job
(wire: mutual TLS under the job's certificate; only the job's processes are served) answers:

- `quorum`: a replica group's manager joins the next quorum and waits for it. The rule is
  torchft 0.2's (its lighthouse, driven with the same requests, forms the same quorums:
  tests/pipeline/parallel/test_ft_quorum_rule.py): of the joined groups whose heartbeats are
  fresh, a quorum forms at once when every member of the previous quorum is back (a fast
  quorum; with `shrink_only`, no newcomer); else it needs `min_replicas` groups and more than
  half of the heartbeating ones (the live groups left out cannot form one of their own at
  the same step), and then every heartbeating group joined or `join_timeout` passed since
  the first joined. Its id grows
  when its members change. A request that times out stays joined until the next quorum.
- `heartbeat`: a group is alive (a quorum request counts as one).
- `set`, `get`, `check`, `add`, `compare_set`, `delete`: the job's record (record), with
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

from pipeline.replicas.auth import host_port
from pipeline.replicas.tls import JobTLS
from pipeline.replicas.wire import Client, RemoteError, Server, expect

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
    """torchft 0.2's lighthouse, in this process (its rule: see the module's docstring).

    `minority_after_join_timeout` (off by default, torchft has no such thing): form a quorum
    of half or fewer of the heartbeating groups once the join timeout passes, so that a group
    goes on while a live peer never asks. Its risk: two such quorums at once (two halves of
    the job, each alive to the other) train apart at the same steps; only the job's record
    (record) then keeps one history, by making one of them take its steps again."""

    def __init__(self, *, min_replicas: int = 1, join_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 5.0, tick_s: float = _TICK_S,
                 minority_after_join_timeout: bool = False) -> None:
        for name, value in (("join_timeout_s", join_timeout_s),
                            ("heartbeat_timeout_s", heartbeat_timeout_s), ("tick_s", tick_s)):
            if not value > 0:
                raise ValueError(f"the lighthouse's {name} must be above 0; got {value!r}: "
                                 f"give a number of seconds")
        if min_replicas < 1:
            raise ValueError(f"a quorum needs at least one group: min_replicas must be 1 or "
                             f"more; got {min_replicas!r}")
        self.min_replicas, self.join_timeout_s = min_replicas, join_timeout_s
        self.heartbeat_timeout_s, self.tick_s = heartbeat_timeout_s, tick_s
        self.minority_after_join_timeout = minority_after_join_timeout
        self._state = threading.Condition()
        self._joined: dict[str, tuple[float, dict[str, Any]]] = {}  # id: (when, member)
        self._beats: dict[str, float] = {}
        self._previous: dict[str, Any] | None = None
        self._quorum_id = 0
        self._waiting: dict[int, dict[str, Any]] = {}  # request: its member
        self._answers: dict[int, dict[str, Any]] = {}  # request: the quorum that holds it
        self._requests = 0
        self._ticker: threading.Thread | None = None

    def heartbeat(self, replica_id: str) -> None:
        with self._state:
            self._beats[replica_id] = time.monotonic()

    def quorum(self, member: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The first quorum formed from now on that holds `member` (its id, its members).

        As torchft's, a request that times out leaves its member joined: the next quorum may
        hold it (its manager asks again at once in practice)."""
        rid = str(member["replica_id"])
        deadline = time.monotonic() + timeout
        with self._state:
            self._requests += 1
            request = self._requests
            self._waiting[request] = member
            self._beats[rid] = time.monotonic()  # a request is a heartbeat too
            self._join(rid, member)
            self._tick()  # torchft looks for a quorum at once on a request
            try:
                while request not in self._answers:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no quorum formed within {timeout:g}s")
                    self._state.wait(left)
                return self._answers[request]
            finally:
                self._waiting.pop(request, None)
                self._answers.pop(request, None)

    def _join(self, rid: str, member: dict[str, Any]) -> None:
        """`member` joins the next quorum (under the lock); a ticker looks for it meanwhile,
        as torchft's does every tick whether anyone waits or not."""
        self._joined[rid] = (time.monotonic(), member)
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_while_joined, daemon=True,
                                            name="pipeline-ft-quorum-tick")
            self._ticker.start()

    def _tick_while_joined(self) -> None:
        with self._state:
            while self._joined:
                self._state.wait(self.tick_s)
                self._tick()
            self._ticker = None

    def _tick(self) -> None:
        """Form a quorum if the rule allows (under the lock): its id grows when its members
        change; requests it does not hold join the next one (torchft's)."""
        now = time.monotonic()
        members = self._ready(now)
        if members is None:
            return
        ids = [m["replica_id"] for m in members]
        if self._previous is None or ids != [p["replica_id"]
                                             for p in self._previous["participants"]]:
            self._quorum_id += 1
        quorum = {"quorum_id": self._quorum_id, "participants": members}
        self._previous = quorum
        self._joined.clear()
        for request, member in self._waiting.items():
            if request in self._answers:
                continue
            if member["replica_id"] in ids:
                self._answers[request] = quorum
            else:
                self._joined[str(member["replica_id"])] = (now, member)
        self._state.notify_all()

    def _ready(self, now: float) -> list[dict[str, Any]] | None:
        """The next quorum's members if one forms now, by torchft 0.2's rule, else None."""
        healthy = {r for r, t in self._beats.items() if now - t < self.heartbeat_timeout_s}
        joined = {r: v for r, v in self._joined.items() if r in healthy}
        if not joined:
            return None
        members = [v[1] for _, v in sorted(joined.items())]
        if self._previous is not None:
            before = {p["replica_id"] for p in self._previous["participants"]}
            if any(v[1].get("shrink_only") for v in joined.values()):
                members = [m for m in members if m["replica_id"] in before]
            if before <= joined.keys():  # a fast quorum: every member of the last is back
                return members
        if len(joined) < self.min_replicas:
            return None
        if 2 * len(joined) <= len(healthy) and not self.minority_after_join_timeout:
            return None  # half or fewer of the live groups: the rest may form one too
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
                      minority_after_join_timeout: bool = False, tls: JobTLS | None = None
                      ) -> Iterator[tuple[Server, Lighthouse, KeyStore]]:
    """The job's coordinator served on `host`:`port` (0: any free port) until the block
    ends; `tls` defaults to `PIPELINE_FT_CERT`'s; `minority_after_join_timeout`: Lighthouse's."""
    lighthouse = Lighthouse(min_replicas=min_replicas, join_timeout_s=join_timeout_s,
                            heartbeat_timeout_s=heartbeat_timeout_s,
                            minority_after_join_timeout=minority_after_join_timeout)
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
    methods record calls)."""

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

    def wait(self, key: str, seconds: float) -> bytes | None:
        """The key's value once it is set, or None if it is not within `seconds` (the
        coordinator holds the request meanwhile: the answer comes the moment it is set)."""
        try:
            return str(self._client.call({"op": "get", "key": key, "timeout": float(seconds)},
                                         seconds + self._timeout)).encode()
        except RemoteError as exc:
            if str(exc).startswith(f"{TimeoutError.__name__}:"):
                return None
            raise

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
