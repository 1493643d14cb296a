"""The library's lighthouse against torchft's own (its Rust server, in this process): the
same random joins, heartbeats, leaves and time passing give the same quorums, quorum ids,
heal assignments and refusals."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings

from tests.strategies import QUORUM_REPLICAS, quorum_scripts

_torchft = pytest.importorskip("torchft._torchft")

from pipeline.replicas.coordinator import Lighthouse  # noqa: E402
from pipeline.replicas.manager import quorum_result  # noqa: E402

pytestmark = pytest.mark.slow

# Outcomes, not timings, are compared; every time below is far from the next so that a loaded
# machine decides the same: joins start GAP apart (all in by 0.15 s), a quorum that waits for
# stragglers forms JOIN s after the first joined, a replica that stops beating expires BEATS
# s after its last beat (well after JOIN, well before ASK), and a request still without a
# quorum after ASK s is refused.
TICK, GAP, JOIN, BEATS, ASK, BEAT_EVERY = 0.02, 0.05, 0.6, 1.5, 2.5, 0.1
FIELDS = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only")


class _Torchft:
    """torchft 0.2's LighthouseServer and a client of it."""

    def __init__(self, min_replicas: int) -> None:
        self.server = _torchft.LighthouseServer(
            bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=int(JOIN * 1e3),
            quorum_tick_ms=int(TICK * 1e3), heartbeat_timeout_ms=int(BEATS * 1e3))
        self.client = _torchft.LighthouseClient(self.server.address(), timedelta(seconds=10))

    def heartbeat(self, rid: str) -> None:
        self.client.heartbeat(rid)

    def quorum(self, member: dict[str, Any]) -> dict[str, Any]:
        got = self.client.quorum(timeout=timedelta(seconds=ASK),
                                 **{k: member[k] for k in FIELDS})
        return {"quorum_id": int(got.quorum_id),
                "participants": [{k: getattr(p, k) for k in FIELDS}
                                 for p in got.participants]}

    def close(self) -> None:
        self.server.shutdown()


class _Library:
    """The library's Lighthouse, as torchft's is driven."""

    def __init__(self, min_replicas: int) -> None:
        self.lighthouse = Lighthouse(min_replicas=min_replicas, join_timeout_s=JOIN,
                                     heartbeat_timeout_s=BEATS, tick_s=TICK)

    def heartbeat(self, rid: str) -> None:
        self.lighthouse.heartbeat(rid)

    def quorum(self, member: dict[str, Any]) -> dict[str, Any]:
        got = self.lighthouse.quorum(member, ASK)
        return {"quorum_id": got["quorum_id"],
                "participants": [{k: p[k] for k in FIELDS} for p in got["participants"]]}

    def close(self) -> None:
        pass


def _outcome(rid: str, quorum: dict[str, Any]) -> tuple[Any, ...]:
    """What a joiner learns: the quorum, and its group rank 0's heal assignment from it."""
    members = tuple(tuple(p[k] for k in FIELDS) for p in quorum["participants"])
    part = quorum_result(rid, 0, quorum, init_sync=True)
    heal = (part.replica_rank, part.recover_src_replica_rank,
            tuple(part.recover_dst_replica_ranks), part.max_step, part.store_address)
    return quorum["quorum_id"], members, heal


def _drive(lighthouse: _Torchft | _Library, script: dict[str, Any]) -> list[dict[str, Any]]:
    """Each round's answers by joiner: its outcome, or 'refused' (no quorum within ASK)."""
    alive: set[str] = set()
    stop = threading.Event()
    lock = threading.Lock()

    def beat() -> None:  # the managers' heartbeats, every BEAT_EVERY s
        while not stop.wait(BEAT_EVERY):
            with lock:
                beating = sorted(alive)
            for rid in beating:
                lighthouse.heartbeat(rid)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    answers: list[dict[str, Any]] = []
    try:
        for round_ in script["rounds"]:
            with lock:
                alive.clear()
                alive.update(round_["alive"])
            for rid in round_["alive"]:
                lighthouse.heartbeat(rid)
            if round_["expire"]:  # the leavers' heartbeats expire; any join timeout passes
                time.sleep(BEATS + 0.5)
            got: dict[str, Any] = {}

            def ask(member: dict[str, Any], got: dict[str, Any] = got) -> None:
                rid = member["replica_id"]
                try:
                    got[rid] = _outcome(rid, lighthouse.quorum(member))
                except TimeoutError:
                    got[rid] = "refused"

            askers = []
            for join in round_["joins"]:
                index = QUORUM_REPLICAS.index(join["replica_id"])
                member = {**join, "address": f"http://127.0.0.1:{9000 + index}",
                          "store_address": f"127.0.0.1:{9100 + index}"}
                askers.append(threading.Thread(target=ask, args=(member,), daemon=True))
                askers[-1].start()
                time.sleep(GAP)
            for t in askers:
                t.join(timeout=ASK + 10)
            answers.append(got)
    finally:
        stop.set()
        beater.join(timeout=5)
        lighthouse.close()
    return answers


@settings(max_examples=10)  # each example sleeps about 3 s: 10 keeps it near half a minute
@given(script=quorum_scripts())
def test_the_library_forms_the_quorums_torchfts_lighthouse_forms(script: dict[str, Any]) -> None:
    results: dict[str, list[dict[str, Any]]] = {}

    def run(name: str, lighthouse: _Torchft | _Library) -> None:
        results[name] = _drive(lighthouse, script)

    drivers = [threading.Thread(target=run, args=("torchft", _Torchft(script["min_replicas"]))),
               threading.Thread(target=run, args=("library", _Library(script["min_replicas"])))]
    for t in drivers:
        t.start()
    for t in drivers:
        t.join()
    assert results["library"] == results["torchft"], script
