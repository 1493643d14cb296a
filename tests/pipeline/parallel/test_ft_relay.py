"""A relay between the job's processes (a machine in the middle, or another local user who
forwards the bytes): it reads nothing and changes nothing, on every server of a replica job
(the lighthouse, the record, a group's manager; heals: test_ft_strangers.py). torchft's servers
and the previous handshake (an HMAC over two nonces, the rest in clear) let a relay read every
request and rewrite answers: a vote of no came back True, `get commit/7` answered 999."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

from pipeline.replicas import tls as ft_tls
from pipeline.replicas.coordinator import Lighthouse, StoreClient, address, serve_coordinator
from pipeline.replicas.manager import ManagerClient, ManagerServer
from pipeline.replicas.wire import Client, RemoteError, Server, WireBroken, WireRefused
from tests.pipeline.parallel.conftest import Relay

WAIT = timedelta(seconds=10)


@pytest.fixture
def job(job_cert: ft_tls.JobTLS) -> Iterator[tuple[Server, Lighthouse, Any]]:
    with serve_coordinator(join_timeout_s=1.0, heartbeat_timeout_s=2.0) as served:
        yield served


def test_a_relayed_record_reads_nothing_and_changes_nothing(
        job: tuple[Server, Lighthouse, Any], relay: type[Relay]) -> None:
    server, _, held = job
    held.set("commit/7", "111")
    middle = relay(server.port)
    store = StoreClient("127.0.0.1", middle.port, 10.0)
    try:
        assert store.get("commit/7") == b"111"
        store.set("note", "a-value-in-clear-4242")
        assert held.get("note") == b"a-value-in-clear-4242"
        for clear in (b"commit/7", b"111", b"a-value-in-clear-4242", b'"op"'):
            assert clear not in middle.seen, clear
        middle.flip = "down"  # the answer to the next request, changed on its way
        with pytest.raises(WireBroken, match="broke mid-request"):
            store.get("commit/7")
        assert middle.forwarded.is_set()
        middle.forwarded.clear()
        assert store.get("commit/7") == b"111"  # a new connection: the value held
        middle.flip = "up"  # a request, changed on its way
        with pytest.raises(WireBroken):
            store.set("commit/3", "999")
        assert middle.forwarded.is_set() and not held.check(["commit/3"])
    finally:
        store.close()


def test_a_relayed_quorum_request_changed_on_its_way_joins_nothing(
        job: tuple[Server, Lighthouse, Any], relay: type[Relay]) -> None:
    server, lighthouse, _ = job
    middle = relay(server.port)
    client = Client("127.0.0.1", middle.port)
    try:
        client.call({"op": "heartbeat", "replica_id": "g0"}, 10.0)
        middle.flip = "up"
        member = {"replica_id": "z", "address": "http://127.0.0.1:1", "step": 10**6,
                  "store_address": "127.0.0.1:2", "world_size": 1, "shrink_only": False,
                  "commit_failures": 0}
        with pytest.raises(WireBroken):
            client.call({"op": "quorum", "member": member, "timeout": 1}, 10.0)
        assert middle.forwarded.is_set() and b"replica_id" not in middle.seen
        assert lighthouse._previous is None and not lighthouse._joined
    finally:
        client.close()


def test_a_relayed_vote_is_never_turned_around(job: tuple[Server, Lighthouse, Any],
                                                relay: type[Relay]) -> None:
    server, _, _ = job
    manager = ManagerServer(replica_id="g0:a", lighthouse_addr=address(server),
                            hostname="ignored", bind="[::]:0", store_addr="127.0.0.1:1",
                            world_size=1, heartbeat_interval=timedelta(seconds=0.2),
                            connect_timeout=WAIT)
    middle = relay(int(manager.address().rsplit(":", 1)[1]))
    client = ManagerClient(f"http://127.0.0.1:{middle.port}", WAIT)
    try:
        assert client.should_commit(0, 4, False, WAIT) is False
        assert b"should_commit" not in middle.seen
        middle.flip = "down"  # the group's no, changed on its way back
        with pytest.raises(WireBroken):
            client.should_commit(0, 5, False, WAIT)
        assert middle.forwarded.is_set()
    finally:
        client._client.close()
        manager.shutdown()


def test_a_client_without_the_jobs_certificate_is_refused(
        job: tuple[Server, Lighthouse, Any]) -> None:
    server, _, held = job
    other = ft_tls.JobTLS(ft_tls.make_job_cert())
    stranger = StoreClient("127.0.0.1", server.port, 5.0, tls=other)
    with pytest.raises(WireRefused, match="not one of the job's processes"):
        stranger.set("commit/3", "999")
    # A request in clear, as the wire's frames are inside TLS: no answer, the socket closed.
    frame = json.dumps({"op": "set", "key": "replicas", "value": "7"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as plain:
        plain.sendall(struct.pack("<I", len(frame)) + frame)
        got = b""
        with contextlib.suppress(ConnectionResetError):  # or closed with unread bytes
            while chunk := plain.recv(4096):
                got += chunk
    assert b"ok" not in got and len(got) < 16, got
    assert not held.check(["commit/3"]) and not held.check(["replicas"])
    deadline = time.monotonic() + 10  # counted by the server's thread, once it closed
    while server.refused < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.refused == 2


def test_a_relay_to_a_server_of_another_job_is_refused(job_cert: ft_tls.JobTLS,
                                                       relay: type[Relay]) -> None:
    """A planted address (another job's server, or a relay to one) leads nowhere: the job's
    client finishes no handshake with it, and sends it nothing."""
    planted = Server(lambda request: {"weights": "mine"}, tls=ft_tls.JobTLS(
        ft_tls.make_job_cert()))
    middle = relay(planted.port)
    try:
        with pytest.raises(WireRefused, match="not one of the job's processes"):
            Client("127.0.0.1", middle.port).call({"op": "get", "key": "k-clear"}, 5.0)
        assert b"k-clear" not in middle.seen
    finally:
        planted.close()


def test_the_connections_of_many_clients_at_once_all_get_their_answers(
        job: tuple[Server, Lighthouse, Any]) -> None:
    server, _, _ = job
    got: list[int] = []

    def one(i: int) -> None:
        store = StoreClient("127.0.0.1", server.port, 30.0)
        try:
            got.append(store.add("n", 1))
        finally:
            store.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(1, 17))


@pytest.mark.parametrize(("request_", "refusal"), [
    ({"op": "get", "key": "k", "timeout": "abc"}, "'timeout' must be a finite number; got 'abc'"),
    ({"op": "add", "key": "n", "amount": "\u00e9"},
     "'amount' must be a whole number; got '\\xe9'"),
    ({"op": "set", "key": 7, "value": "v"}, "'key' must be text; got 7"),
    ({"op": "check", "keys": "k"}, "'keys' must be a list"),
    ({"op": "quorum", "member": {"replica_id": None}, "timeout": 1},
     "'replica_id' must be text; got None"),
    ({"op": "get", "key": "k", "timeout": float("nan")}, "'timeout' must be a finite number"),
    ({"op": "\u00e9t\u00e9"}, "no operation '\\xe9t\\xe9'"),
])
def test_a_malformed_request_field_is_refused_by_name(
        job: tuple[Server, Lighthouse, Any], request_: dict[str, Any], refusal: str) -> None:
    server, _, _ = job
    client = Client("127.0.0.1", server.port)
    try:
        with pytest.raises(RemoteError) as refused:
            client.call(request_, 10.0)
        assert refusal in str(refused.value) and "Traceback" not in str(refused.value)
        assert client.call({"op": "add", "key": "n", "amount": 1}, 10.0) == 1  # served on
    finally:
        client.close()


def test_a_malformed_vote_is_refused_by_name(job: tuple[Server, Lighthouse, Any]) -> None:
    server, _, _ = job
    manager = ManagerServer(replica_id="g0:a", lighthouse_addr=address(server),
                            hostname="ignored", bind="[::]:0", store_addr="127.0.0.1:1",
                            world_size=1, heartbeat_interval=timedelta(seconds=0.2),
                            connect_timeout=WAIT)
    client = Client("127.0.0.1", int(manager.address().rsplit(":", 1)[1]))
    try:
        with pytest.raises(RemoteError, match="'should_commit' must be true or false; got 'no'"):
            client.call({"op": "should_commit", "rank": 0, "step": 1, "should_commit": "no",
                         "timeout": 5}, 10.0)
        with pytest.raises(RemoteError, match="'rank' must be a whole number; got True"):
            client.call({"op": "checkpoint_metadata", "rank": True}, 10.0)
    finally:
        client.close()
        manager.shutdown()
