"""A replica group's manager server and its clients, in place of torchft's Rust ones.

torchft's Manager (Python) drives the step protocol through a `ManagerServer` on group rank 0
and a `ManagerClient` on every rank; both are gRPC in Rust, unauthenticated, and the server
has a `Kill` call that ends the process for anyone who sends it. These two take their place
(`install` puts them in torchft.manager's namespace, where the Manager looks them up) with the
same calls, over wire (mutual TLS under the job's certificate) and with no kill:

- `quorum`: every rank of the group asks; once all have, the server asks the job's lighthouse
  (coordinator) for the next quorum holding this group, and each rank gets its part of it:
  its rank among the replicas, whom it heals from or sends to, the quorum's store (torchft's
  `compute_quorum_results`, the same rule);
- `should_commit`: the ranks' votes, True for all once every rank voted yes;
- `agree`: the same gathering for this library's own questions to the group (a group at the
  end of its loop ends only if every rank saw every replica with it: hold), kept apart from
  torchft's vote, which commits a step when it says yes;
- `checkpoint_metadata`: where a healing peer fetches this group's rank r checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from pipeline.replicas.auth import bind_host, host_port
from pipeline.replicas.coordinator import lighthouse_hostport
from pipeline.replicas.wire import Client, Server, expect

__all__ = ["ManagerClient", "ManagerServer", "QuorumResult", "install", "quorum_result"]


@dataclass
class QuorumResult:
    """What one rank learns from a quorum (torchft's QuorumResult)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: int | None
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: int | None
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str] = field(default_factory=list)


def quorum_result(replica_id: str, rank: int, quorum: dict[str, Any],
                  init_sync: bool) -> QuorumResult:
    """Group rank `rank`'s part of `quorum`, for the group `replica_id` (torchft's rule)."""
    members = sorted(quorum["participants"], key=lambda p: p["replica_id"])
    ids = [p["replica_id"] for p in members]
    if replica_id not in ids:
        raise RuntimeError(f"replica {replica_id} is not in the quorum it was given")
    me = ids.index(replica_id)
    max_step = max(p["step"] for p in members)
    at_max = [p for p in members if p["step"] == max_step]
    primary = at_max[rank % len(at_max)]  # whose store the quorum's process group meets at
    behind = [i for i, p in enumerate(members) if p["step"] != max_step or (
        init_sync and max_step == 0 and p["replica_id"] != primary["replica_id"])]
    current = [i for i in range(len(members)) if i not in behind]
    sends: dict[int, list[int]] = {}
    source = None
    for i, dst in enumerate(behind):  # spread the heals over the up-to-date groups
        src = current[(i + rank) % len(current)]
        sends.setdefault(src, []).append(dst)
        if dst == me:
            source = src
    max_rank = next((i for i, p in enumerate(at_max) if p["replica_id"] == replica_id), None)
    return QuorumResult(
        quorum_id=int(quorum["quorum_id"]), replica_rank=me, replica_world_size=len(members),
        recover_src_manager_address=members[source]["address"] if source is not None else "",
        recover_src_replica_rank=source, recover_dst_replica_ranks=sends.get(me, []),
        store_address=primary["store_address"], max_step=max_step, max_replica_rank=max_rank,
        max_world_size=len(at_max), heal=source is not None,
        commit_failures=max(int(p.get("commit_failures", 0)) for p in members),
        replica_ids=ids)


class _Round:
    """One gathering of the group's ranks (for a quorum or a vote) and its outcome."""

    def __init__(self) -> None:
        self.ranks: set[int] = set()
        self.noes: set[int] = set()  # ranks that voted no (a vote's round)
        self.done = threading.Event()
        self.value: Any = None
        self.error: str | None = None


class ManagerServer:
    """Group rank 0's server (torchft's signature): the group's quorums, votes and heal
    addresses, a heartbeat to the lighthouse every `heartbeat_interval`."""

    def __init__(self, replica_id: str, lighthouse_addr: str, hostname: str, bind: str,
                 store_addr: str, world_size: int, heartbeat_interval: timedelta,
                 connect_timeout: timedelta, quorum_retries: int = 0) -> None:
        del hostname  # the address advertised is the one bound
        self._replica_id, self._store_addr, self._world_size = replica_id, store_addr, world_size
        self._lighthouse = Client(*lighthouse_hostport(lighthouse_addr),
                                  connect_timeout=connect_timeout.total_seconds())
        self._beats = Client(*lighthouse_hostport(lighthouse_addr),
                             connect_timeout=connect_timeout.total_seconds())
        self._lock = threading.Lock()
        self._metadata: dict[int, str] = {}
        self._quorum = _Round()
        self._vote = _Round()
        self._agreement = _Round()
        host = bind_host(lighthouse_addr)
        self._server = Server(self._handle, host=host,
                              port=int(bind.rsplit(":", 1)[1]), name="pipeline-ft-manager")
        self._address = f"http://{host_port(host, self._server.port)}"
        self._stop = threading.Event()
        self._interval = heartbeat_interval.total_seconds()
        self._beat_thread = threading.Thread(target=self._beat, name="pipeline-ft-heartbeat",
                                             daemon=True)
        self._beat_thread.start()

    def address(self) -> str:
        return self._address

    def shutdown(self) -> None:
        self._stop.set()
        self._server.close()
        self._beat_thread.join(timeout=5.0)
        self._lighthouse.close()
        self._beats.close()

    def _beat(self) -> None:
        while not self._stop.is_set():
            # The lighthouse restarting or gone: the next quorum says so.
            with contextlib.suppress(Exception):
                self._beats.call({"op": "heartbeat", "replica_id": self._replica_id},
                                 max(1.0, 4 * self._interval))
            self._stop.wait(self._interval)

    def _handle(self, request: dict[str, Any]) -> Any:
        op = expect(request, "op", str)
        if op == "quorum":
            return self._gather_quorum(request)
        if op == "should_commit":
            return self._gather_vote(request, "_vote", "should_commit")
        if op == "agree":
            return self._gather_vote(request, "_agreement", "yes")
        if op == "checkpoint_metadata":
            rank = expect(request, "rank", int)
            with self._lock:
                if rank not in self._metadata:
                    raise KeyError(f"no checkpoint metadata for rank {rank}")
                return self._metadata[rank]
        raise ValueError(f"no operation {ascii(op)[:80]}")

    def _gather_quorum(self, request: dict[str, Any]) -> Any:
        rank, timeout = expect(request, "rank", int), expect(request, "timeout", float)
        metadata = expect(request, "checkpoint_metadata", str)
        step, shrink_only = expect(request, "step", int), expect(request, "shrink_only", bool)
        failures, init_sync = expect(request, "commit_failures", int), expect(request,
                                                                            "init_sync", bool)
        with self._lock:
            self._metadata[rank] = metadata
            gathering = self._quorum
            gathering.ranks.add(rank)
            last = len(gathering.ranks) >= self._world_size
            if last:
                self._quorum = _Round()
        if last:  # this rank's request completes the group: it asks the lighthouse
            member = {"replica_id": self._replica_id, "address": self._address,
                      "store_address": self._store_addr, "step": step,
                      "world_size": self._world_size, "shrink_only": shrink_only,
                      "commit_failures": failures}
            try:
                gathering.value = self._lighthouse.call(
                    {"op": "quorum", "member": member, "timeout": timeout}, timeout + 5.0)
            except Exception as exc:
                gathering.error = f"the lighthouse gave no quorum: {exc}"
            gathering.done.set()
        if not gathering.done.wait(timeout + 10.0):
            raise TimeoutError(f"the group's ranks did not all ask for a quorum within "
                               f"{timeout:g}s")
        if gathering.error is not None:
            raise RuntimeError(gathering.error)
        return asdict(quorum_result(self._replica_id, rank, gathering.value, init_sync))

    def _gather_vote(self, request: dict[str, Any], rounds: str, field: str) -> Any:
        """One rank's yes or no in the round `rounds` names (a vote to commit, or an
        agreement); True for all once every rank said yes."""
        rank, timeout = expect(request, "rank", int), expect(request, "timeout", float)
        yes = expect(request, field, bool)
        with self._lock:
            gathering = getattr(self, rounds)
            gathering.ranks.add(rank)
            if not yes:
                gathering.noes.add(rank)
            if len(gathering.ranks) >= self._world_size:
                gathering.value = not gathering.noes
                setattr(self, rounds, _Round())
                gathering.done.set()
        if not gathering.done.wait(timeout):
            raise TimeoutError(f"the group's ranks did not all vote within {timeout:g}s")
        return gathering.value


class ManagerClient:
    """A rank's client of its group's ManagerServer (torchft's signature and calls)."""

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        host, port = lighthouse_hostport(addr)
        self._client = Client(host, port, connect_timeout=connect_timeout.total_seconds())

    def _call(self, request: dict[str, Any], timeout: timedelta) -> Any:
        seconds = timeout.total_seconds()
        return self._client.call(request, seconds + 15.0)

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                timeout: timedelta, commit_failures: int,
                init_sync: bool = True) -> QuorumResult:
        seconds = timeout.total_seconds()
        part = self._call({"op": "quorum", "rank": group_rank, "step": step,
                           "checkpoint_metadata": checkpoint_metadata,
                           "shrink_only": shrink_only, "commit_failures": commit_failures,
                           "init_sync": init_sync, "timeout": seconds}, timeout)
        return QuorumResult(**part)

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return str(self._call({"op": "checkpoint_metadata", "rank": rank}, timeout))

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: timedelta) -> bool:
        return bool(self._call({"op": "should_commit", "rank": group_rank, "step": step,
                                "should_commit": should_commit,
                                "timeout": timeout.total_seconds()}, timeout))

    def agree(self, group_rank: int, yes: bool, timeout: timedelta) -> bool:
        """True once every rank of the group said yes (False if one said no): a question of
        this library's, which commits nothing."""
        return bool(self._call({"op": "agree", "rank": group_rank, "yes": yes,
                                "timeout": timeout.total_seconds()}, timeout))


def install() -> None:
    """torchft's Manager builds these in place of its Rust server and client (from now on in
    this process: a heal looks the client up again when it happens)."""
    import torchft.manager as torchft_manager

    torchft_manager.ManagerServer = ManagerServer
    torchft_manager.ManagerClient = ManagerClient
