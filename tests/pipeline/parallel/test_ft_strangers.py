"""Replica groups closed to strangers: heals, checkpoint fetches and quorums prove the job's secret,
every server binds loopback, and a heal read has one deadline and a size bound."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeline import PipeConfigError
from tests.other_user import other_user, start_as_other

pytest.importorskip("torchft")

from pipeline.parallel import ft_auth
from pipeline.parallel.ft_transport import HealRefused, SignedTransport

SECRET = bytes(range(32))
WAIT = timedelta(seconds=10)


def _state(step: int, value: float = 1.0) -> dict[str, Any]:
    """What torchft's Manager sends in a heal: the user's state and its own step count."""
    return {"user": {"pipe": {"w": torch.full((3,), value)}},
            "torchft": {"step": step, "batches_committed": 2 * step}}


@pytest.fixture
def source() -> Iterator[SignedTransport]:
    transport = SignedTransport(WAIT, secret=SECRET)
    yield transport
    transport.shutdown()


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(__import__("ipaddress").ip_address(words)))
    return found


# -- the heal transport ------------------------------------------------------------------------
def test_a_heal_between_the_jobs_ranks_carries_the_state(source: SignedTransport) -> None:
    source.send_checkpoint([1], 5, _state(5, 2.0), WAIT)
    healing = SignedTransport(WAIT, secret=SECRET)
    try:
        got = healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    finally:
        healing.shutdown()
    assert got["torchft"] == {"step": 5, "batches_committed": 10}
    assert torch.equal(got["user"]["pipe"]["w"], torch.full((3,), 2.0))


def test_servers_bind_loopback(source: SignedTransport) -> None:
    """torchft binds its checkpoint server and its manager to every interface (`[::]`):
    another user fetched a checkpoint and killed a rank over the host's address."""
    from torchft._torchft import ManagerServer
    from torchft.coordination import LighthouseServer

    port = int(source.metadata().split(":")[2].split("/")[0])
    assert _listening(port) == {"127.0.0.1"}
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        lighthouse_addr = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
        with ft_auth._servers_bound(ft_auth.bind_host(lighthouse_addr, environ={})):
            import torchft.manager

            server = torchft.manager.ManagerServer(
                replica_id="r:0", lighthouse_addr=lighthouse_addr, hostname="somehost",
                bind="[::]:0", store_addr="127.0.0.1:1", world_size=1,
                heartbeat_interval=timedelta(seconds=1), connect_timeout=WAIT,
                quorum_retries=0)
        assert torchft.manager.ManagerServer is ManagerServer  # restored
        try:
            address = server.address()
            assert address.startswith("http://127.0.0.1:")
            assert _listening(int(address.rsplit(":", 1)[1])) == {"127.0.0.1"}
        finally:
            server.shutdown()
    finally:
        lighthouse.shutdown()


def test_the_bind_setting_names_an_address_and_a_spread_job_must_set_it() -> None:
    assert ft_auth.bind_host("http://localhost:29510", environ={}) == "127.0.0.1"
    env = {ft_auth.BIND_ENV: "10.0.0.7"}
    assert ft_auth.bind_host("http://10.0.0.1:29510", environ=env) == "10.0.0.7"
    with pytest.raises(PipeConfigError, match=r"lighthouse is at 'http://10.0.0.1:29510'.*"
                                              r"PIPELINE_FT_BIND"):
        ft_auth.bind_host("http://10.0.0.1:29510", environ={})
    for bad in ("eth0", "0.0.0.0", "::"):
        with pytest.raises(PipeConfigError, match=rf"PIPELINE_FT_BIND must be .* got {bad!r}"):
            ft_auth.bind_host(None, environ={ft_auth.BIND_ENV: bad})


def test_the_secret_is_64_hex_digits_and_never_shown() -> None:
    made = ft_auth.job_secret_env()
    assert ft_auth.job_secret(made) == bytes.fromhex(made[ft_auth.SECRET_ENV])
    assert ft_auth.job_secret({ft_auth.SECRET_ENV: " "}) is None
    for bad in ("abc", "zz" * 32, "ab" * 31):
        with pytest.raises(PipeConfigError, match=r"64 hex digits") as err:
            ft_auth.job_secret({ft_auth.SECRET_ENV: bad})
        assert bad not in str(err.value)


def test_a_request_without_the_secret_is_refused_and_logged(
        source: SignedTransport, caplog: pytest.LogCaptureFixture) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    other_job = SignedTransport(WAIT, secret=bytes(32))
    try:
        with pytest.raises(HealRefused, match="answered 403"):
            other_job.recv_checkpoint(0, source.metadata(), 5, WAIT)
    finally:
        other_job.shutdown()
    assert "refused a checkpoint request from 127.0.0.1" in caplog.text


def test_the_source_must_hold_the_quorums_step(source: SignedTransport) -> None:
    """A quorum claiming step 10**6 (a stranger's claim) heals nothing: the signed source
    holds its own step, and the step count would have been forged."""
    source.send_checkpoint([1], 10**6, _state(12), WAIT)
    healing = SignedTransport(WAIT, secret=SECRET)
    try:
        with pytest.raises(HealRefused, match=r"holds step 12, not the quorum's step 1000000"):
            healing.recv_checkpoint(0, source.metadata(), 10**6, WAIT)
    finally:
        healing.shutdown()


class _Payload:
    """A pickle that would run `touch <path>` when loaded without weights_only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (subprocess.call, (["touch", self.path],))


def test_a_signed_checkpoint_holding_code_is_refused(source: SignedTransport,
                                                     tmp_path: Path) -> None:
    """The secret proves who sent it, not what it holds: it is still read as plain data."""
    planted = tmp_path / "ran"
    source.send_checkpoint([1], 5, {"torchft": {"step": 5}, "x": _Payload(str(planted))}, WAIT)
    healing = SignedTransport(WAIT, secret=SECRET)
    try:
        with pytest.raises(HealRefused, match=r"not plain data.*(Weights only|Unsupported)"):
            healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    finally:
        healing.shutdown()
    assert not planted.exists()


def test_a_checkpoint_over_the_bound_is_refused_unread(source: SignedTransport) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    healing = SignedTransport(WAIT, secret=SECRET, max_bytes=100)
    try:
        with pytest.raises(HealRefused, match=r"bytes; a heal is bounded by 100"):
            healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    finally:
        healing.shutdown()


# -- strangers as another local user -----------------------------------------------------------
_FETCH = """
import sys, urllib.request, urllib.error
for url in (sys.argv[1], sys.argv[1] + "?nonce=00&proof=" + "0" * 64):
    try:
        with urllib.request.urlopen(url, timeout=20) as f:
            print("GOT", len(f.read()))
    except urllib.error.HTTPError as e:
        print("HTTP", e.code)
"""


@other_user
def test_a_stranger_fetching_a_checkpoint_is_refused(source: SignedTransport,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    stranger = start_as_other(_FETCH, source.metadata() + "5/full")
    out, err = stranger.communicate(timeout=60)
    assert out.split() == ["HTTP", "403", "HTTP", "403"], err
    assert caplog.text.count("refused a checkpoint request") == 2


# A heal source another user runs: it answers every request with a body of its choosing, a
# made-up proof, or a byte a second.
_SOURCE = """
import socket, sys, time
mode = sys.argv[1]
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.recv(65536)
    if mode == "drip":
        for b in b"HTTP/1.0 200 OK\\r\\nContent-Length: 100\\r\\n\\r\\n" + b"x" * 100:
            conn.sendall(bytes([b]))
            time.sleep(1)
    else:
        body = b"weights of my choosing" + bytes(32)
        proof = "X-Pipeline-Proof: " + "ab" * 32 + "\\r\\n" if mode == "proof" else ""
        conn.sendall(("HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n%s\\r\\n"
                      % (len(body), proof)).encode() + body)
    conn.close()
"""


def _stranger_source(mode: str) -> tuple[subprocess.Popen[str], str]:
    stranger = start_as_other(_SOURCE, mode)
    assert stranger.stdout is not None
    port = stranger.stdout.readline().strip()
    assert port.isdigit(), stranger.stderr.read() if stranger.stderr else ""
    return stranger, f"http://127.0.0.1:{port}/checkpoint/"


@other_user
@pytest.mark.parametrize("mode", ["bare", "proof"])
def test_a_forged_heal_source_is_refused_and_logged(mode: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    stranger, address = _stranger_source(mode)
    healing = SignedTransport(WAIT, secret=SECRET)
    try:
        with pytest.raises(HealRefused, match="does not prove the job's secret"):
            healing.recv_checkpoint(1, address, 5, WAIT)
    finally:
        healing.shutdown()
        stranger.kill()
        stranger.communicate()
    assert "heal refused, nothing applied" in caplog.text


@other_user
def test_a_dripping_peer_is_cut_at_the_deadline() -> None:
    """A byte a second: torchft's transport was still reading after 30 s of a 3 s timeout
    (its timeout bounds each read, not the transfer)."""
    stranger, address = _stranger_source("drip")
    healing = SignedTransport(WAIT, secret=SECRET)
    began = time.monotonic()
    try:
        with pytest.raises(HealRefused, match=r"within the heal's deadline \(\d+ bytes read\)"):
            healing.recv_checkpoint(1, address, 5, timedelta(seconds=2))
    finally:
        healing.shutdown()
        stranger.kill()
        stranger.communicate()
    # The old transport never ended here (a read a second, each within its timeout).
    assert time.monotonic() - began < 30


# -- quorum membership -------------------------------------------------------------------------
def _quorum(**fields: Any) -> SimpleNamespace:
    base = dict(quorum_id=7, replica_ids=["g0:a", "g1:b"], max_step=3, heal=False,
                recover_src_manager_address="", store_address="127.0.0.1:100")
    return SimpleNamespace(**{**base, **fields})


def _member(rid: str, index: int) -> ft_auth.Member:
    return ft_auth.Member(rid, f"http://127.0.0.1:{200 + index}", f"127.0.0.1:{100 + index}")


def test_each_participant_must_sign_this_quorum_what_it_claims() -> None:
    """The gate's check, against forged, missing, replayed and unclaimed entries."""
    store = torch.distributed.HashStore()
    gate = ft_auth.QuorumGate(None, secret=SECRET, me=_member("g0:a", 0), group_rank=0,
                              store=store, entry_wait=0.0)
    prefix = "pipeline/ft/member/7/0/"
    store.set(prefix + "g1:b", _member("g1:b", 1).entry(SECRET, 7, 0, 3))
    assert gate._check(_quorum(), 3, time.monotonic() + 5) is None
    assert gate._check(_quorum(replica_ids=["g0:a", "g1:b", "x:y"]), 3,
                       time.monotonic() + 5) == "participant 'x:y' signed no entry: it does " \
                                                "not hold the job's secret"
    forged = {"another key": _member("g1:b", 1).entry(bytes(32), 7, 0, 3),
              "another quorum": _member("g1:b", 1).entry(SECRET, 6, 0, 3),
              "another rank": _member("g1:b", 1).entry(SECRET, 7, 1, 3),
              "another step": "1000000 " + _member("g1:b", 1).entry(SECRET, 7, 0, 3)[2:],
              "garbage": "x"}
    for why, entry in forged.items():
        store.set(prefix + "g1:b", entry)
        assert "does not prove the job's secret" in str(gate._check(_quorum(), 3, 0.0)), why
    store.set(prefix + "g1:b", _member("g1:b", 1).entry(SECRET, 7, 0, 9))
    assert "is no participant's signed step" in str(gate._check(_quorum(max_step=10**6), 3, 0))
    assert "heal source 'http://evil:1'" in str(gate._check(
        _quorum(max_step=9, heal=True, recover_src_manager_address="http://evil:1"), 3, 0))
    assert "store 'evil:1'" in str(gate._check(
        _quorum(max_step=9, store_address="evil:1"), 3, 0))
    assert gate._check(_quorum(max_step=9, heal=True, store_address="127.0.0.1:101",
                               recover_src_manager_address="http://127.0.0.1:201"), 3, 0) is None
    # With no record, the entries are in the quorum's store: a stranger's names its own.
    lone = ft_auth.QuorumGate(None, secret=SECRET, me=_member("g0:a", 0), group_rank=0,
                              entry_wait=0.5)
    assert "the store of the entries failed" in str(lone._check(
        _quorum(store_address="127.0.0.1:1"), 3, time.monotonic() + 5))


def test_a_stranger_in_the_quorum_is_refused_until_it_leaves(
        caplog: pytest.LogCaptureFixture) -> None:
    """torchft's own ManagerServer, as any local user can run it, joins the lighthouse
    claiming step 10**6: without the gate every rank healed from it. The job's groups refuse
    each quorum it is in (nothing healed or averaged) and form theirs once it is gone."""
    from torchft._torchft import ManagerClient, ManagerServer
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=500)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    store = torch.distributed.HashStore()
    servers = []

    def group(rid: str) -> tuple[Any, ManagerClient]:
        server = ManagerServer(replica_id=rid, lighthouse_addr=address, hostname="127.0.0.1",
                               bind="127.0.0.1:0", store_addr=f"127.0.0.1:{len(servers) + 1}",
                               world_size=1, heartbeat_interval=timedelta(milliseconds=100),
                               connect_timeout=WAIT, quorum_retries=0)
        servers.append(server)
        return server, ManagerClient(server.address(), connect_timeout=WAIT)

    gates = []
    for g in (0, 1):
        rid = f"pipeline_replica_{g}:{uuid.uuid4()}"
        server, client = group(rid)
        me = ft_auth.Member(rid, server.address(), f"127.0.0.1:{len(servers)}")
        gates.append(ft_auth.QuorumGate(client, secret=SECRET, me=me, group_rank=0,
                                        store=store, entry_wait=1.0))
    _, stranger = group("pipeline_replica_1:stranger")
    leave = threading.Event()

    def join_forever() -> None:
        while not leave.is_set():
            with contextlib.suppress(Exception):  # it is not in every quorum it asks for
                stranger._quorum(group_rank=0, step=10**6, checkpoint_metadata="",
                                 shrink_only=False, timeout=timedelta(seconds=2),
                                 init_sync=True, commit_failures=0)

    def ask(gate: ft_auth.QuorumGate, seconds: float, results: list[Any]) -> None:
        try:
            results.append(gate._quorum(group_rank=0, step=3, checkpoint_metadata="",
                                        shrink_only=False, timeout=timedelta(seconds=seconds),
                                        init_sync=True, commit_failures=0))
        except Exception as exc:
            results.append(exc)

    def both(seconds: float) -> list[Any]:
        results: list[Any] = []
        threads = [threading.Thread(target=ask, args=(g, seconds, results)) for g in gates]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 30)
        return results

    joiner = threading.Thread(target=join_forever, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeline"):
            joiner.start()
            time.sleep(0.5)  # it is in the lighthouse's next quorum
            refused = both(4.0)
            assert len(refused) == 2 and all(isinstance(r, ft_auth.QuorumRefused)
                                              for r in refused), refused
            assert "'pipeline_replica_1:stranger' signed no entry" in caplog.text
            leave.set()
            servers[2].shutdown()  # its heartbeats stop: the lighthouse drops it
            joiner.join(timeout=30)
            formed = both(30.0)
        assert len(formed) == 2 and not any(isinstance(q, Exception) for q in formed), formed
        for q in formed:
            assert sorted(q.replica_ids) == sorted(g._me.replica_id for g in gates)
            assert q.max_step == 3 and not q.heal
    finally:
        leave.set()
        for server in servers[:2]:
            server.shutdown()
        lighthouse.shutdown()


# -- the group's vote to commit ----------------------------------------------------------------
def _voters(decision: bool, store: Any) -> list[ft_auth.QuorumGate]:
    client = SimpleNamespace(should_commit=lambda *args, timeout: decision)
    return [ft_auth.QuorumGate(client, secret=SECRET, me=_member("g0:a", 0), group_rank=r,
                               store=store, world_size=2, entry_wait=1.0) for r in (0, 1)]


def _vote(gates: list[ft_auth.QuorumGate], votes: list[bool]) -> list[bool]:
    results: dict[int, bool] = {}

    def one(r: int) -> None:
        results[r] = gates[r].should_commit(r, 4, votes[r], timeout=WAIT)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(gates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [results[r] for r in range(len(gates))]


def test_a_commit_needs_every_ranks_signed_yes() -> None:
    store = torch.distributed.HashStore()
    gates = _voters(True, store)
    assert _vote(gates, [True, True]) == [True, True]
    # The manager said yes (it counted another process's vote for rank 1), rank 1 said no.
    assert _vote(gates, [True, False]) == [False, False]
    assert _vote(gates, [True, True]) == [True, True]
    assert _vote(_voters(False, torch.distributed.HashStore()), [True, True]) == [False, False]


def test_a_strangers_vote_for_a_rank_commits_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """torchft's manager counts one vote per group rank from any caller: another process's
    yes for rank 1 made rank 0 commit alone. Its vote is not signed: rank 0 commits nothing."""
    from torchft._torchft import ManagerClient, ManagerServer
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    server = ManagerServer(replica_id="g0:a", lighthouse_addr=address, hostname="127.0.0.1",
                           bind="127.0.0.1:0", store_addr="127.0.0.1:1", world_size=2,
                           heartbeat_interval=timedelta(seconds=1), connect_timeout=WAIT,
                           quorum_retries=0)
    try:
        stranger = ManagerClient(server.address(), connect_timeout=WAIT)
        voted = threading.Thread(target=stranger.should_commit, args=(1, 4, True),
                                 kwargs={"timeout": WAIT})
        voted.start()
        client = ManagerClient(server.address(), connect_timeout=WAIT)
        assert client.should_commit(0, 4, True, timeout=WAIT) is True  # torchft: counted
        voted.join(timeout=30)
        voted = threading.Thread(target=stranger.should_commit, args=(1, 4, True),
                                 kwargs={"timeout": WAIT})
        voted.start()
        gate = ft_auth.QuorumGate(client, secret=SECRET, me=_member("g0:a", 0), group_rank=0,
                                  store=torch.distributed.HashStore(), world_size=2,
                                  entry_wait=1.0)
        with caplog.at_level(logging.WARNING, logger="pipeline"):
            assert gate.should_commit(0, 4, True, timeout=WAIT) is False
        voted.join(timeout=30)
        assert "group rank(s) [1] signed no yes" in caplog.text
    finally:
        server.shutdown()
        lighthouse.shutdown()


@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
def test_a_manager_built_for_the_job_heals_nothing_from_a_stranger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's Manager as FaultTolerance builds it (build_manager): a stranger claiming
    step 10**6 in every quorum is never healed from (no state loaded, step 0) and the rank
    raises QuorumRefused; once it is gone the group forms its quorum and commits its step."""
    from torch.distributed import TCPStore
    from torchft._torchft import ManagerClient, ManagerServer
    from torchft.coordination import LighthouseServer
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=500)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    stranger_server = ManagerServer(
        replica_id="pipeline_replica_1:stranger", lighthouse_addr=address,
        hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="127.0.0.1:1", world_size=1,
        heartbeat_interval=timedelta(milliseconds=100), connect_timeout=WAIT, quorum_retries=0)
    stranger = ManagerClient(stranger_server.address(), connect_timeout=WAIT)
    leave = threading.Event()

    def join_forever() -> None:
        while not leave.is_set():
            with contextlib.suppress(Exception):
                stranger._quorum(group_rank=0, step=10**6, checkpoint_metadata="",
                                 shrink_only=False, timeout=timedelta(seconds=2),
                                 init_sync=True, commit_failures=0)

    loaded: list[Any] = []
    record = torch.distributed.HashStore()  # the launcher's record, where entries are signed

    def manager() -> Any:
        built = ft_auth.build_manager(
            secret=SECRET, record_store=record, pg=ProcessGroupGloo(timeout=WAIT),
            load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, timeout=WAIT, quorum_timeout=timedelta(seconds=3),
            connect_timeout=WAIT, rank=0, world_size=1,
            checkpoint_transport=SignedTransport(WAIT, secret=SECRET),
            lighthouse_addr=address, replica_id="pipeline_replica_0")
        built.register_state_dict_fn("pipe", loaded.append, lambda: {"w": torch.ones(2)})
        return built

    joiner = threading.Thread(target=join_forever, daemon=True)
    first = second = None
    try:
        first = manager()
        assert isinstance(first._client, ft_auth.QuorumGate)
        joiner.start()
        time.sleep(0.5)
        with pytest.raises(ft_auth.QuorumRefused, match="pipeline_replica_1:stranger"):
            first.start_quorum()
        assert loaded == [] and first.current_step() == 0 and first.errored() is None
        leave.set()
        stranger_server.shutdown()
        joiner.join(timeout=30)
        first.shutdown(wait=False)  # the rank exited; its launcher restarts the group
        first = None
        second = manager()
        second.start_quorum()
        assert second.num_participants() == 1 and loaded == []
        assert second.should_commit() is True and second.current_step() == 1
    finally:
        leave.set()
        for built in (first, second):
            if built is not None:
                built.shutdown(wait=False)
        lighthouse.shutdown()
