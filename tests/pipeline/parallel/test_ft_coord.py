"""The job's lighthouse, record and managers (coordinator, manager over ft_wire): torchft's
quorum rule, TCPStore's semantics, and only the job's own processes served: no dashboard, no
kill, no quorum or vote or record entry from a process without the job's certificate."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.other_user import other_user, start_as_other

pytest.importorskip("torchft")

from pipeline.replicas import auth as ft_auth
from pipeline.replicas import tls as ft_tls
from pipeline.replicas import wire as ft_wire
from pipeline.replicas.coordinator import Lighthouse, StoreClient, address, serve_coordinator
from pipeline.replicas.coordinator import lighthouse_hostport as address_of
from pipeline.replicas.heal_transport import HealTransport
from pipeline.replicas.manager import ManagerClient, ManagerServer, quorum_result
from pipeline.replicas.wire import Client, Server, WireRefused
from tests.pipeline.parallel.conftest import JOB_PEM
from tests.pipeline.parallel.test_ft_strangers import _listening

OTHER = ft_tls.JobTLS(ft_tls.make_job_cert())  # another job's certificate
WAIT = timedelta(seconds=10)


@pytest.fixture
def job(job_cert: ft_tls.JobTLS) -> Iterator[tuple[Server, Lighthouse, Any]]:
    """The job's coordinator, this process holding the job's certificate."""
    with serve_coordinator(join_timeout_s=1.0, heartbeat_timeout_s=2.0) as served:
        yield served


def _member(rid: str, step: int, **fields: Any) -> dict[str, Any]:
    index = ord(rid[0])
    return {"replica_id": rid, "address": f"http://127.0.0.1:{index}", "step": step,
            "store_address": f"127.0.0.1:{1000 + index}", "world_size": 1,
            "shrink_only": False, "commit_failures": 0, **fields}


def _ask(lighthouse: Lighthouse, members: list[dict[str, Any]],
         timeout: float = 10.0) -> tuple[list[threading.Thread], dict[str, Any]]:
    """Each member asks for a quorum from its own thread; the answers by replica id."""
    got: dict[str, Any] = {}

    def one(m: dict[str, Any]) -> None:
        try:
            got[m["replica_id"]] = lighthouse.quorum(m, timeout)
        except Exception as exc:
            got[m["replica_id"]] = exc

    threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in members]
    for t in threads:
        t.start()
    return threads, got


def _ids(quorum: dict[str, Any]) -> list[str]:
    return [p["replica_id"] for p in quorum["participants"]]


# -- the quorum rule (torchft's) ---------------------------------------------------------------
def test_a_quorum_waits_for_every_live_group_then_the_same_members_keep_its_id() -> None:
    lighthouse = Lighthouse(join_timeout_s=30.0, heartbeat_timeout_s=30.0)
    lighthouse.heartbeat("b")  # alive, still in its step
    threads, got = _ask(lighthouse, [_member("a", 3)])
    time.sleep(0.3)
    assert threads[0].is_alive()  # b is waited for
    more, _ = _ask(lighthouse, [_member("b", 3)])
    for t in threads + more:
        t.join(timeout=10)
    assert _ids(got["a"]) == ["a", "b"] and got["a"]["quorum_id"] == 1
    threads, got = _ask(lighthouse, [_member("a", 4), _member("b", 4)])
    for t in threads:
        t.join(timeout=10)
    assert got["a"] == got["b"] and got["a"]["quorum_id"] == 1  # the same members: one id


def test_a_silent_group_is_dropped_once_its_heartbeats_stop() -> None:
    lighthouse = Lighthouse(join_timeout_s=30.0, heartbeat_timeout_s=0.5)
    lighthouse.heartbeat("b")  # both known before either asks
    threads, got = _ask(lighthouse, [_member("a", 1), _member("b", 1)])
    for t in threads:
        t.join(timeout=10)
    assert _ids(got["a"]) == ["a", "b"]
    began = time.monotonic()
    threads, got = _ask(lighthouse, [_member("a", 2)])  # b lost: no request, no heartbeat
    while threads[0].is_alive() and time.monotonic() - began < 10:
        lighthouse.heartbeat("a")  # its manager's heartbeats go on while it waits
        threads[0].join(timeout=0.1)
    assert _ids(got["a"]) == ["a"] and got["a"]["quorum_id"] == 2
    assert 0.2 < time.monotonic() - began < 5.0


def test_a_live_group_that_does_not_join_is_waited_for_the_join_timeout() -> None:
    lighthouse = Lighthouse(join_timeout_s=0.5, heartbeat_timeout_s=30.0)
    lighthouse.heartbeat("c")
    began = time.monotonic()
    threads, got = _ask(lighthouse, [_member("a", 0), _member("b", 0)])
    for t in threads:
        t.join(timeout=10)
    assert _ids(got["a"]) == ["a", "b"] and 0.4 < time.monotonic() - began < 5.0


@pytest.mark.parametrize("live", [2, 4])
def test_half_the_live_groups_form_no_quorum_unless_the_option_says_so(live: int) -> None:
    """torchft's rule: a quorum that is not a fast one needs more than half of the groups
    that heartbeat, however long the rest take to ask; `minority_after_join_timeout` forms
    it once the join timeout passes (the groups that met before make it no fast quorum)."""
    ids = "abcd"[:live]
    for minority in (False, True):
        lighthouse = Lighthouse(join_timeout_s=0.3, heartbeat_timeout_s=30.0,
                                minority_after_join_timeout=minority)
        for r in ids:
            lighthouse.heartbeat(r)
        threads, got = _ask(lighthouse, [_member(r, 0) for r in ids])
        for t in threads:
            t.join(timeout=10)
        assert _ids(got["a"]) == list(ids)  # they met
        half = [_member(r, 1) for r in ids[:live // 2]]
        threads, got = _ask(lighthouse, half, timeout=1.5)
        for t in threads:
            t.join(timeout=10)
        if minority:
            assert _ids(got["a"]) == list(ids[:live // 2]) and got["a"]["quorum_id"] == 2
        else:
            assert all(isinstance(got[m["replica_id"]], TimeoutError) for m in half), got


def test_shrink_only_keeps_newcomers_out_and_a_quorum_request_times_out() -> None:
    lighthouse = Lighthouse(join_timeout_s=0.2, heartbeat_timeout_s=30.0)
    threads, _ = _ask(lighthouse, [_member("a", 1)])
    threads[0].join(timeout=10)
    with lighthouse._state:  # both asking at once (threads would race to the lock)
        lighthouse._join("c", _member("c", 2))
        lighthouse._join("a", _member("a", 2, shrink_only=True))
        lighthouse._tick()
        assert lighthouse._previous is not None and _ids(lighthouse._previous) == ["a"]
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no quorum formed within 0\.3s"):
        Lighthouse(min_replicas=2).quorum(_member("c", 2), 0.3)
    assert time.monotonic() - began < 5


def test_each_rank_gets_its_part_of_a_quorum_by_torchfts_rule() -> None:
    quorum = {"quorum_id": 4, "participants": [_member(r, s) for r, s in
                                               (("d", 3), ("c", 5), ("b", 3), ("a", 5))]}
    parts = {(rid, rank): quorum_result(rid, rank, quorum, init_sync=True)
             for rid in "abcd" for rank in (0, 1)}
    assert parts["a", 0].recover_dst_replica_ranks == [1] and not parts["a", 0].heal
    assert parts["c", 0].recover_dst_replica_ranks == [3]
    b = parts["b", 0]
    assert (b.heal, b.recover_src_replica_rank, b.recover_src_manager_address) == (
        True, 0, _member("a", 5)["address"])
    assert (b.replica_rank, b.replica_world_size, b.max_step, b.max_world_size,
            b.max_replica_rank) == (1, 4, 5, 2, None)
    assert parts["a", 0].max_replica_rank == 0 and parts["c", 0].max_replica_rank == 1
    # Rank 1 of each group meets at another primary's store and heals from the other source.
    assert b.store_address == _member("a", 5)["store_address"]
    assert parts["b", 1].store_address == _member("c", 5)["store_address"]
    assert parts["b", 1].recover_src_replica_rank == 2
    assert parts["a", 0].replica_ids == ["a", "b", "c", "d"]
    # At step 0, with init_sync, every group but the primary starts from its weights.
    fresh = {"quorum_id": 1, "participants": [_member("a", 0), _member("b", 0)]}
    assert quorum_result("b", 0, fresh, init_sync=True).recover_src_replica_rank == 0
    assert not quorum_result("b", 0, fresh, init_sync=False).heal
    with pytest.raises(RuntimeError, match="not in the quorum"):
        quorum_result("x", 0, fresh, init_sync=True)


# -- the record ----------------------------------------------------------------------------------
def test_the_record_answers_as_tcpstore(job: tuple[Server, Lighthouse, Any]) -> None:
    server, _, held = job
    store = StoreClient("127.0.0.1", server.port, 10.0)
    try:
        assert not store.check(["k"])
        assert store.compare_set("k", "x", "y") == b"x"  # missing, expected not empty
        assert store.compare_set("k", "", "1") == b"1" and store.get("k") == b"1"
        assert store.compare_set("k", "", "2") == b"1"  # held: not replaced
        assert store.compare_set("k", "1", "3") == b"3"
        assert store.add("n", 2) == 2 and store.add("n", 0) == 2
        store.set("s", "a b")
        assert store.check(["s", "k"]) and held.get("s") == b"a b"
        assert store.delete_key("s") and not store.delete_key("s")
    finally:
        store.close()


# -- only the job's processes --------------------------------------------------------------------
def test_a_process_without_the_certificate_reaches_nothing(
        job: tuple[Server, Lighthouse, Any], caplog: pytest.LogCaptureFixture) -> None:
    server, _, held = job
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        stranger = StoreClient("127.0.0.1", server.port, 5.0, tls=OTHER)
        with pytest.raises(WireRefused, match="not one of the job's processes"):
            stranger.set("commit/1", "666")
        quorum = Client("127.0.0.1", server.port, tls=OTHER)
        with pytest.raises(WireRefused):
            quorum.call({"op": "quorum", "member": _member("s", 10**6), "timeout": 1}, 5.0)
    deadline = time.monotonic() + 10  # counted by the server's thread
    while server.refused < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not held.check(["commit/1"]) and server.refused == 2
    assert "refused (no TLS handshake under the job's certificate" in caplog.text
    # And the job's own client is not fooled by a server of another job.
    other = Server(lambda request: {"weights": "mine"}, tls=OTHER)
    try:
        with pytest.raises(WireRefused, match="not one of the job's processes"):
            Client("127.0.0.1", other.port).call({"op": "get"}, 5.0)
    finally:
        other.close()
    plain = socket.create_server(("127.0.0.1", 0))  # torchft's lighthouse, say
    try:
        threading.Thread(target=lambda: plain.accept()[0].sendall(b"HTTP/1.1 400\r\n\r\n"),
                         daemon=True).start()
        with pytest.raises(WireRefused, match="not one of the job's processes"):
            Client("127.0.0.1", plain.getsockname()[1]).call({}, 5.0)
    finally:
        plain.close()


def test_silent_connections_do_not_hold_a_quorum_up(job: tuple[Server, Lighthouse, Any]) -> None:
    """One fake quorum request froze torchft's lighthouse for a minute: here a connection
    that completes no handshake holds a thread of its own until its deadline, no lock."""
    server, lighthouse, _ = job
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    idle[0].sendall(b"\0" * 10)  # half a hello
    try:
        began = time.monotonic()
        threads, got = _ask(lighthouse, [_member("a", 1)], timeout=10.0)
        client = StoreClient("127.0.0.1", server.port, 10.0)
        client.set("x", "1")
        threads[0].join(timeout=10)
        assert _ids(got["a"]) == ["a"] and time.monotonic() - began < 5.0
        client.close()
    finally:
        for s in idle:
            s.close()


def _manager(replica_id: str, world_size: int = 1, **fields: Any) -> ManagerServer:
    return ManagerServer(replica_id=replica_id, lighthouse_addr=fields.pop("lighthouse"),
                         hostname="ignored", bind="[::]:0", store_addr="127.0.0.1:1",
                         world_size=world_size, heartbeat_interval=timedelta(seconds=0.2),
                         connect_timeout=WAIT)


def test_a_groups_commit_needs_every_ranks_yes_and_its_servers_bind_loopback(
        job: tuple[Server, Lighthouse, Any]) -> None:
    server, _, _ = job
    manager = _manager("g0:a", world_size=2, lighthouse=address(server))
    try:
        assert manager.address().startswith("http://127.0.0.1:")
        assert _listening(int(manager.address().rsplit(":", 1)[1])) == {"127.0.0.1"}
        assert _listening(server.port) == {"127.0.0.1"}
        clients = [ManagerClient(manager.address(), WAIT) for _ in range(2)]
        def vote(r: int, yes: bool, got: dict[int, bool]) -> None:
            got[r] = clients[r].should_commit(r, 4, yes, WAIT)

        for votes, want in (([True, True], True), ([True, False], False),
                            ([True, True], True)):
            got: dict[int, bool] = {}
            threads = [threading.Thread(target=vote, args=(r, votes[r], got)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert got == {0: want, 1: want}
    finally:
        manager.shutdown()


# A local user who found the job's ports (any user may list listening sockets): torchft's
# dashboard and kill requests, a gRPC preface, and 48 bytes of zeros. It prints what each port
# answered.
_PROBE = """
import socket, sys
for port in sys.argv[1:]:
    for payload in (b"GET /status HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n",
                    b"POST /replica/pipeline_replica_0/kill HTTP/1.1\\r\\nHost: x\\r\\n"
                    b"Content-Length: 0\\r\\n\\r\\n",
                    b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n",
                    bytes(48)):
        s = socket.create_connection(("127.0.0.1", int(port)), timeout=20)
        s.sendall(payload)
        got = b""
        while True:
            try:
                chunk = s.recv(4096)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        print(port, got[:17].decode(errors="replace"), len(got), flush=True)
"""


@other_user
def test_a_stranger_finds_no_dashboard_no_kill_and_no_quorum(
        job: tuple[Server, Lighthouse, Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's lighthouse lists the replicas (`/status`) and ends one on a POST to
    `/replica/<id>/kill`; its managers end the process on a gRPC `Kill`: any local user
    could do both. Here each port answers a stranger no more than a TLS alert, and closes."""
    server, _, _ = job
    monkeypatch.setattr(ft_wire, "HANDSHAKE_S", 1.0)  # what completes nothing is closed sooner
    manager = _manager("pipeline_replica_0:a", lighthouse=address(server))
    manager_port = manager.address().rsplit(":", 1)[1]
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline"):
            stranger = start_as_other(_PROBE, str(server.port), manager_port)
            out, err = stranger.communicate(timeout=120)
        lines = out.splitlines()
        assert len(lines) == 8, err
        # No answer, or a TLS alert (7 bytes): no HTTP, no gRPC, nothing of the job.
        assert all(int(line.split()[-1]) <= 7 and "HTTP" not in line for line in lines), lines
        # The job goes on: its group forms a quorum through its manager.
        client = ManagerClient(manager.address(), WAIT)
        part = client._quorum(group_rank=0, step=0, checkpoint_metadata="m",
                              shrink_only=False, timeout=WAIT, commit_failures=0)
        assert part.replica_ids == ["pipeline_replica_0:a"] and not part.heal
        assert client._checkpoint_metadata(0, WAIT) == "m"
        assert caplog.text.count("a connection refused") == 8
    finally:
        manager.shutdown()


@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
def test_a_manager_built_for_the_job_trains_beside_a_stranger(
        job: tuple[Server, Lighthouse, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's Manager as FaultTolerance builds it: a process of another job (another
    certificate) asking the lighthouse for a quorum at step 10**6 in a loop is refused; the group
    forms its quorum alone, heals nothing and commits its step."""
    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo

    server, _, _ = job
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    leave, refused = threading.Event(), []

    def join_forever() -> None:
        stranger = Client("127.0.0.1", server.port, tls=OTHER)
        while not leave.is_set():
            try:
                stranger.call({"op": "quorum", "member": _member("z", 10**6),
                               "timeout": 1}, 5.0)
            except WireRefused:
                refused.append(1)

    joiner = threading.Thread(target=join_forever, daemon=True)
    joiner.start()
    loaded: list[Any] = []
    manager = ft_auth.build_manager(
        pg=ProcessGroupGloo(timeout=WAIT), load_state_dict=None, state_dict=None,
        min_replica_size=1, use_async_quorum=False, timeout=WAIT, quorum_timeout=WAIT,
        connect_timeout=WAIT, rank=0, world_size=1,
        checkpoint_transport=HealTransport(WAIT),
        lighthouse_addr=address(server), replica_id="pipeline_replica_0")
    try:
        manager.register_state_dict_fn("pipe", loaded.append, lambda: {"w": torch.ones(2)})
        for step in (1, 2):
            manager.start_quorum()
            assert manager.num_participants() == 1 and loaded == []
            assert manager.should_commit() is True and manager.current_step() == step
        assert refused
    finally:
        leave.set()
        joiner.join(timeout=30)
        manager.shutdown(wait=False)


def _serve_alone() -> subprocess.Popen[str]:
    """`python -m pipeline.replica_launch --record` with the job's certificate."""
    env = {**os.environ, ft_tls.CERT_ENV: JOB_PEM}
    return subprocess.Popen([sys.executable, "-m", "pipeline.replica_launch", "--record"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_coordinator_served_alone_prints_what_groups_export() -> None:
    """`python -m pipeline.replica_launch --record`, for groups started by hand: its
    lighthouse and record answer the job's processes only, and SIGTERM ends it."""
    served = _serve_alone()
    try:
        assert served.stdout is not None
        line = served.stdout.readline().split()
        exports = dict(word.split("=", 1) for word in line[1:])
        assert line[0] == "export" and set(exports) == {"TORCHFT_LIGHTHOUSE",
                                                        "PIPELINE_FT_RECORD"}
        port = int(exports["PIPELINE_FT_RECORD"])
        assert address_of(exports["TORCHFT_LIGHTHOUSE"]) == ("127.0.0.1", port)
        store = StoreClient("127.0.0.1", port, 10.0, tls=ft_tls.JobTLS(JOB_PEM))
        assert store.add("n", 1) == 1
        with pytest.raises(WireRefused):
            StoreClient("127.0.0.1", port, 10.0, tls=OTHER).add("n", 1)
        store.close()
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=30) == 0
    finally:
        if served.poll() is None:
            served.kill()
        served.communicate()


def test_the_coordinator_served_alone_takes_sigterm_from_the_moment_its_line_is_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that reads the exports line and stops the coordinator at once: its handler
    was installed after the line was printed, so on a loaded machine the SIGTERM came first
    and killed it by the signal (3 of 10 starts beside busy processes). Here a SIGTERM is
    raised as the line is written: served in this process, it must end `serve` with 0."""
    from pipeline.replicas import record as ft_record

    monkeypatch.setenv(ft_tls.CERT_ENV, JOB_PEM)
    seen: list[Any] = []

    class Out:
        def write(self, text: str) -> int:
            if text.startswith("export "):
                seen.append(signal.getsignal(signal.SIGTERM))
                if seen[0] is signal.SIG_DFL:  # raised now, it would end pytest: later
                    threading.Timer(0.5, signal.raise_signal, (signal.SIGTERM,)).start()
                else:
                    signal.raise_signal(signal.SIGTERM)
            return len(text)

        def flush(self) -> None:
            pass

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(sys, "stdout", Out())
    try:
        assert ft_record.serve() == 0
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert seen and seen[0] is not signal.SIG_DFL, "SIGTERM's default action was still set"


def test_groups_started_by_hand_make_the_jobs_certificate_and_need_it() -> None:
    """`--make-cert` prints a certificate and key to export everywhere; the coordinator served
    alone without one says so and serves nothing (no job runs in clear)."""
    env = {k: v for k, v in os.environ.items() if k != ft_tls.CERT_ENV}
    made = subprocess.run([sys.executable, "-m", "pipeline.replica_launch", "--make-cert"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    assert ft_tls.job_tls({ft_tls.CERT_ENV: made.stdout}).cert_der
    bare = subprocess.run([sys.executable, "-m", "pipeline.replica_launch", "--record"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stdout == "", bare.stdout
    assert "PIPELINE_FT_CERT is not set" in bare.stderr and "--make-cert" in bare.stderr
