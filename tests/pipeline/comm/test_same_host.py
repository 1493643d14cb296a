"""pipeline.comm.same_host: same-host links, their setup, and who may use them."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable

import pytest
import torch

from pipeline.comm import link_auth
from pipeline.comm import same_host as local_link
from pipeline.comm.same_host import (
    ENV,
    SPIN_ENV,
    WAKE,
    LinkBroken,
    LinkFallbackWarning,
    LinkSend,
    SocketLink,
    connect,
    host_key,
    spin_setting,
    spin_time,
)
from pipeline.comm.wire import memory
from pipeline.errors import PipeConfigError
from tests.other_user import other_user, run_as_other, start_as_other


def _pair() -> tuple[SocketLink, SocketLink]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return SocketLink(a), SocketLink(b)


def _recv(link: SocketLink, size: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype)
    link.recv_into([memory(out)], time.monotonic() + 30)
    return out


def _send(link: SocketLink, *tensors: torch.Tensor) -> LinkSend:
    """One message of the tensors' own memory (held by the send until it is written)."""
    return link.send([memory(t) for t in tensors], tensors)


def test_messages_arrive_whole_and_in_order() -> None:
    a, b = _pair()
    sent = [torch.arange(n, dtype=torch.uint8) for n in (1, 7, 200)]
    header = torch.arange(8, dtype=torch.int64)
    works = [_send(a, t) for t in sent] + [_send(a, header)]
    assert all(w.done() for w in works)  # small messages go in the caller's thread
    for t in sent:
        assert torch.equal(_recv(b, t.numel()), t)
    assert torch.equal(_recv(b, 8, torch.int64), header)


def test_a_message_larger_than_the_socket_buffer_never_blocks_the_sender() -> None:
    # Both ends send 32 MiB before either reads: with blocking writes this deadlocks. The part
    # the socket cannot take goes to the writer thread, in order behind nothing.
    # (A blocking send would hang here, until the test's timeout.)
    a, b = _pair()
    big = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
    sends = [_send(a, big), _send(b, big.flip(0))]
    assert not sends[0].done()  # returned before anything was read
    small = _send(a, torch.full((3,), 9, dtype=torch.uint8))  # queued behind the big one
    assert torch.equal(_recv(b, big.numel()), big)
    assert torch.equal(_recv(b, 3), torch.full((3,), 9, dtype=torch.uint8))
    assert torch.equal(_recv(a, big.numel()), big.flip(0))
    for work in (*sends, small):
        work.wait(time.monotonic() + 30)
        assert work.done()


def test_one_message_of_several_buffers_is_read_into_several_destinations() -> None:
    # Scatter-gather both ways: the sender's buffers need not match the receiver's.
    a, b = _pair()
    x, ids = torch.randn(3, 5), torch.arange(7)
    work = _send(a, x, ids)
    assert work.done()
    head, rest, got_ids = torch.empty(4), torch.empty(11), torch.empty(7, dtype=torch.int64)
    b.recv_into([memory(head), memory(rest), memory(got_ids)], time.monotonic() + 30)
    assert torch.equal(torch.cat([head, rest]), x.view(-1))
    assert torch.equal(got_ids, ids)


def test_a_send_the_socket_cannot_take_keeps_its_memory_after_the_caller_releases_it() -> None:
    # The rest of a large message is written later from the sender's own memory, not a copy:
    # the send holds an alias, so a stage output released meanwhile (`.data` swapped for an
    # empty tensor, as split_backward.release does) still goes out whole.
    a, b = _pair()
    out = torch.randn(4 << 20) * 1  # 16 MiB, more than the socket buffer
    expected = out.clone()
    work = a.send([memory(out)], out.detach())
    assert not work.done()
    out.data = torch.empty(0)
    del out
    assert torch.equal(_recv(b, expected.numel(), torch.float32), expected)
    work.wait(time.monotonic() + 30)
    assert work.done() and work.keep is None  # the alias goes once written


def test_a_wait_checks_for_failures_while_nothing_arrives() -> None:
    a, _b = _pair()
    ticks: list[float] = []

    def tick(now: float) -> None:
        ticks.append(now)
        if len(ticks) == 3:
            raise RuntimeError("a failure elsewhere")

    with pytest.raises(RuntimeError, match="a failure elsewhere"):
        a.recv_into([memory(torch.empty(4, dtype=torch.uint8))], time.monotonic() + 30, tick)
    assert ticks[-1] - ticks[0] >= WAKE  # one check per WAKE, not a busy loop


def test_a_wait_woken_by_the_bytes_reads_them_without_checking_for_failures() -> None:
    # A failure check reads the rendezvous store (a round trip to another process): on the
    # wake-up that brings the awaited bytes it would delay every message after a long wait.
    a, b = _pair()
    ticks: list[float] = []
    payload = torch.arange(4, dtype=torch.uint8)
    threading.Timer(WAKE / 5, lambda: _send(b, payload)).start()
    out = torch.empty(4, dtype=torch.uint8)
    a.recv_into([memory(out)], time.monotonic() + 30, ticks.append)
    assert torch.equal(out, payload)
    assert ticks == []


def test_a_send_written_by_the_writer_thread_ends_its_wait_without_a_failure_check() -> None:
    a, b = _pair()
    big = torch.ones(16 << 20, dtype=torch.uint8)  # more than the socket buffer (8 MiB at most)
    work = _send(a, big)
    assert not work.done()
    threading.Timer(WAKE / 5, lambda: _recv(b, big.numel())).start()
    ticks: list[float] = []
    work.wait(time.monotonic() + 30, ticks.append)
    assert work.done() and ticks == []


def test_a_wait_times_out() -> None:
    a, _b = _pair()
    with pytest.raises(TimeoutError):
        a.recv_into([memory(torch.empty(4, dtype=torch.uint8))], time.monotonic() + 2 * WAKE)


def test_a_closed_peer_breaks_the_wait_at_once() -> None:
    a, b = _pair()
    threading.Timer(0.2, b.close).start()
    with pytest.raises(LinkBroken, match="closed"):  # not the TimeoutError of the deadline
        a.recv_into([memory(torch.empty(4, dtype=torch.uint8))], time.monotonic() + 30)
    with pytest.raises(LinkBroken):
        for _ in range(100):  # the kernel reports the broken pipe on a later write
            _send(a, torch.zeros(1 << 16, dtype=torch.uint8))


class _Store:
    """The rendezvous store's get/set, shared by threads standing in for ranks."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cv:
            self._data[key] = value.encode()
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        with self._cv:
            assert self._cv.wait_for(lambda: key in self._data, timeout=30), key
            return self._data[key]


def _connect_all(store: _Store, ranks: list[int]) -> list[dict[int, SocketLink]]:
    out: list[dict[int, SocketLink]] = [{} for _ in ranks]

    def run(me: int) -> None:
        out[me] = connect(store, ranks, me, timeout=10)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_connect_links_every_pair_on_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    links = _connect_all(_Store(), [0, 1, 2])
    assert [sorted(x) for x in links] == [[1, 2], [0, 2], [0, 1]]
    msg = torch.arange(5, dtype=torch.uint8)
    _send(links[2][0], msg)
    assert torch.equal(_recv(links[0][2], 5), msg)
    # Three processes here: they spin where each has a CPU of its own.
    spin = spin_time(3, None)
    assert all(link.spin == spin for mine in links for link in mine.values())
    # The launcher's count of the job's processes here counts too (other groups' ranks).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0)) + 1))
    assert all(link.spin == 0.0 for mine in _connect_all(_Store(), [0, 1, 2])
               for link in mine.values())


def test_connect_leaves_ranks_on_other_hosts_to_the_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    real = host_key()
    # Rank 1 publishes another host's key: it links to nobody, and nobody to it.
    monkeypatch.setattr("pipeline.comm.same_host.host_key",
                        lambda: real + ("/other" if threading.current_thread().name == "1"
                                        else ""))

    out: list[dict[int, SocketLink]] = [{}, {}, {}]

    def run(me: int) -> None:
        out[me] = connect(store, [0, 1, 2], me, timeout=10)

    threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [sorted(x) for x in out] == [[2], [], [0]]


def test_the_environment_turns_links_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    assert _connect_all(_Store(), [0, 1]) == [{}, {}]


# -- who may link -------------------------------------------------------------------------------
# An impostor is another process of this user that learns rank 0's socket name (from
# /proc/net/unix, where abstract names are listed for everyone) and connects before rank 1.
_IMPOSTOR = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + sys.argv[1])
print("connected", flush=True)
sock.settimeout(120)  # a hang guard: the listener closes a connection it refuses
try:
    # The listener may close it before these bytes go (another uid's: at once).
    sock.sendall(bytes.fromhex(sys.argv[2]))
    while sock.recv(4096):
        pass
    print("closed", flush=True)
except (BrokenPipeError, ConnectionResetError):
    print("closed", flush=True)
except TimeoutError:
    print("still open", flush=True)
"""


class _ImpostorFirst(_Store):
    """Starts an impostor process, once connected to rank 0's socket, before anyone can read
    rank 0's address: it is first in the backlog. `payload(record)` gives its bytes."""

    def __init__(self, payload: Callable[[str], bytes]) -> None:
        super().__init__()
        self.payload = payload
        self.impostor: subprocess.Popen[str] | None = None

    def set(self, key: str, value: str) -> None:
        if key.endswith("/host/0") and self.impostor is None:
            name = value.split("\n")[1]
            self.impostor = subprocess.Popen(
                [sys.executable, "-c", _IMPOSTOR, name, self.payload(value).hex()],
                stdout=subprocess.PIPE, text=True)
            assert self.impostor.stdout is not None
            assert self.impostor.stdout.readline() == "connected\n"
        super().set(key, value)

    def impostor_saw(self) -> str:
        assert self.impostor is not None and self.impostor.stdout is not None
        out = self.impostor.stdout.readline().strip()
        self.impostor.wait(60)
        return out


def _secret_hello(record: str, claimed: int, *, wrong: bool = False) -> bytes:
    """A hello well formed in every way (rank 1's secret with rank 0), or with a wrong key."""
    secret = local_link._parse_record(record)[3][claimed]
    return link_auth.hello(bytes(32) if wrong else secret, claimed, 0, os.urandom(16))


@pytest.mark.parametrize("payload", [
    # The old handshake, then data: it once became rank 0's "rank 1" (rank 0 read these
    # bytes as rank 1's message; the real rank 1 got a broken pipe).
    pytest.param(lambda _: struct.pack("<q", 1) + b"INJECTED" * 64, id="old-rank-and-data"),
    pytest.param(lambda _: b"", id="nothing"),
    pytest.param(lambda _: os.urandom(200), id="garbage"),
    pytest.param(lambda record: _secret_hello(record, 1, wrong=True), id="wrong-secret"),
    # The right secret, rank and form, but not rank 1's process: its pid gives it away.
    pytest.param(lambda record: _secret_hello(record, 1), id="wrong-pid"),
])
def test_an_impostor_that_connects_first_is_refused_and_the_ranks_still_link(
        payload: Callable[[str], bytes]) -> None:
    store = _ImpostorFirst(payload)
    links = _connect_all(store, [0, 1])
    assert [sorted(x) for x in links] == [[1], [0]]
    msg = torch.arange(16, dtype=torch.uint8)
    _send(links[1][0], msg)
    assert torch.equal(_recv(links[0][1], 16), msg)
    _send(links[0][1], msg.flip(0))
    assert torch.equal(_recv(links[1][0], 16), msg.flip(0))
    assert store.impostor_saw() == "closed"


def test_a_connector_is_checked_before_any_data() -> None:
    # The checks themselves, one at a time, on a socket pair (its peer is this process).
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    secret, nonce = os.urandom(32), os.urandom(16)
    pid = os.getpid()
    expect = {1: (pid, secret)}
    assert link_auth.check_hello(a, link_auth.hello(secret, 1, 0, nonce), expect, 0) == 1
    for hello, expected, why in [
        (link_auth.hello(secret, 2, 0, nonce), expect, "rank 2 is not an expected caller"),
        (link_auth.hello(secret, 1, 0, nonce), {1: (pid + 1, secret)}, f"pid {pid}"),
        (link_auth.hello(os.urandom(32), 1, 0, nonce), expect, "does not prove"),
        (link_auth.hello(secret, 1, 3, nonce), expect, "does not prove"),  # for another pair
        (b"x" * link_auth.HELLO, expect, "not a link's hello"),
    ]:
        with pytest.raises(link_auth.Refused, match=why):
            link_auth.check_hello(a, hello, expected, 0)
    a.close()
    b.close()


class _FailsOnce(_Store):
    """Rank 1's first address never reaches the store (the store write fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def set(self, key: str, value: str) -> None:
        if key.endswith("/host/1") and value and not self.failed:
            self.failed = True
            raise ConnectionError("the store is unreachable")
        super().set(key, value)


def test_a_failed_connect_on_one_rank_leaves_the_next_in_step() -> None:
    # Before: rank 0 waited for rank 1's address under a round rank 1 never finished (until
    # the store's timeout); then every later round waited on a counter one step apart.
    store = _FailsOnce()
    errors: list[str] = []
    out: list[dict[int, SocketLink]] = [{}, {}]

    def run(me: int) -> None:
        try:
            out[me] = connect(store, [0, 1], me, timeout=10)
        except BaseException as exc:  # rank 0's wait for the address ended by _Store's guard
            errors.append(f"rank {me}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["rank 1: ConnectionError: the store is unreachable"]
    assert out == [{}, {}]  # rank 0 went on without a link to rank 1
    links = _connect_all(store, [0, 1])  # the next round links both ways
    assert [sorted(x) for x in links] == [[1], [0]]
    _send(links[0][1], torch.arange(3, dtype=torch.uint8))
    assert torch.equal(_recv(links[1][0], 3), torch.arange(3, dtype=torch.uint8))


def test_links_off_on_one_rank_only_keep_every_rank_in_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 has PIPELINE_LOCAL_P2P=0: rank 0 links to nobody, without waiting for it.
    real = os.environ.get
    monkeypatch.setattr("pipeline.comm.same_host.os.environ.get", lambda k, d=None: (
        "0" if k == ENV and threading.current_thread().name == "1" else real(k, d)))
    store = _Store()
    out: list[dict[int, SocketLink]] = [{}, {}]

    def run(me: int) -> None:
        out[me] = connect(store, [0, 1], me, timeout=10)

    threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [{}, {}]
    monkeypatch.undo()
    assert [sorted(x) for x in _connect_all(store, [0, 1])] == [[1], [0]]


# -- spinning before sleeping -------------------------------------------------------------------
class _CountingPoll:
    """Stands in for a link's poll object, counting the sleeps."""

    def __init__(self, real: object) -> None:
        self.real, self.calls = real, 0

    def poll(self, timeout: float) -> object:
        self.calls += 1
        return self.real.poll(timeout)  # type: ignore[attr-defined]


def _later(link: SocketLink, delay: float, value: int) -> threading.Thread:
    def send() -> None:
        time.sleep(delay)
        _send(link, torch.full((4,), value, dtype=torch.uint8))

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.mark.parametrize(("spin", "delay", "sleeps"), [
    (1.0, 0.02, False),   # arrives while the receive spins: it never sleeps
    (0.0, 0.02, True),    # no spinning: it sleeps in poll until the bytes arrive
    (0.01, 0.2, True),    # arrives after the spin: the receive went on to sleep, and wakes
])
def test_a_receive_spins_for_its_time_then_sleeps(spin: float, delay: float,
                                                  sleeps: bool) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = SocketLink(a), SocketLink(b, spin)
    counting = _CountingPoll(receiver._readable)
    receiver._readable = counting  # type: ignore[assignment]
    thread = _later(sender, delay, 7)
    assert torch.equal(_recv(receiver, 4), torch.full((4,), 7, dtype=torch.uint8))
    thread.join()
    assert (counting.calls > 0) == sleeps


def test_a_spinning_receive_still_times_out() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = SocketLink(b, 0.05)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.recv_into([memory(torch.empty(4, dtype=torch.uint8))], start + 0.1)
    assert time.monotonic() - start < 0.1 + 0.05 + 2 * WAKE + 1.0  # spin, then the poll wakes
    a.close()


def test_spinning_is_on_only_while_each_process_has_a_cpu(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert spin_setting() is None
    assert spin_time(cpus, None) == local_link.SPIN > 0
    assert spin_time(cpus + 1, None) == 0.0  # a shared core: the peer needs it to send
    for raw, seconds in (("0", 0.0), ("150", 150e-6), ("2.5", 2.5e-6)):
        monkeypatch.setenv(SPIN_ENV, raw)
        assert spin_setting() == pytest.approx(seconds)
        assert spin_time(cpus + 1, spin_setting()) == pytest.approx(seconds)  # the user's say
    for raw in ("fast", "-1", "1e9", "nan"):
        monkeypatch.setenv(SPIN_ENV, raw)
        with pytest.raises(PipeConfigError, match=rf"PIPELINE_SPIN_US must be .* got '{raw}'"):
            spin_setting()


# -- strangers: another local user, the store open to all -------------------------------------
# Runs as uid 65534: fills the listen backlog of the socket named argv[1] (connecting and
# closing its end: a connection waits in the backlog until it is taken, whoever closed it),
# stopping at the first EAGAIN or after argv[2] connections; reports how many got in.
_FLOOD = """
import socket, sys
count = 0
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect("\\0" + sys.argv[1])
    except BlockingIOError:
        sock.close()
        break
    sock.close()
    count += 1
print(count, flush=True)
"""


class _FloodFirst(_Store):
    """Before anyone can read rank 0's address, a process of another user fills its
    socket's backlog (it watched /proc/net/unix, where every user sees the new name)."""

    def __init__(self) -> None:
        super().__init__()
        self.flooded = -1

    def set(self, key: str, value: str) -> None:
        if key.endswith("/host/0") and self.flooded < 0:
            done = run_as_other(_FLOOD, value.split("\n")[1], "5000")
            assert done.returncode == 0, done.stderr
            self.flooded = int(done.stdout)
        super().set(key, value)


@other_user
def test_a_stranger_filling_the_backlog_first_does_not_stop_the_link() -> None:
    # Before: the backlog held size + 1 connections (3 for a pair) and nothing took them until
    # the store was read; rank 1's connect failed with EAGAIN, was taken for a refusal, and
    # the pair fell back to gloo without a word. Now connections are taken (another uid's
    # closed at once) from the moment the socket exists, and EAGAIN is retried.
    store = _FloodFirst()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LinkFallbackWarning)
        links = _connect_all(store, [0, 1])
    assert store.flooded > 0
    assert [sorted(x) for x in links] == [[1], [0]]
    _send(links[1][0], torch.arange(4, dtype=torch.uint8))
    assert torch.equal(_recv(links[0][1], 4), torch.arange(4, dtype=torch.uint8))


class _Redirected(_Store):
    """What rank 1 reads as rank 0's address is `record(rank 0's real record)`."""

    def __init__(self, record: Callable[[str], str]) -> None:
        super().__init__()
        self.record = record

    def get(self, key: str) -> bytes:
        value = super().get(key)
        if key.endswith("/host/0") and threading.current_thread().name == "1":
            return self.record(value.decode()).encode()
        return value


def _connect_named(store: _Store, ranks: list[int], timeout: float = 10
                   ) -> tuple[list[dict[int, SocketLink]], list[str], list[str]]:
    """connect on threads named by rank; the links, errors and LinkFallbackWarnings."""
    out: list[dict[int, SocketLink]] = [{} for _ in ranks]
    errors: list[str] = []

    def run(me: int) -> None:
        try:
            out[me] = connect(store, ranks, me, timeout=timeout)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    said = [str(w.message) for w in seen if issubclass(w.category, LinkFallbackWarning)]
    return out, sorted(errors), sorted(said)


def _elsewhere(record: str) -> str:
    """Rank 0's record with a socket name nobody bound (a container's own network
    namespace)."""
    host, _, pid, secrets = record.split("\n")
    return "\n".join([host, "pipeline-" + "0" * 32, pid, secrets])


def test_a_pair_on_one_host_that_cannot_link_falls_back_with_a_warning_naming_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the pair went over gloo without a word (a latency-bound job several times
    # slower, nobody told why).
    monkeypatch.delenv(ENV, raising=False)
    links, errors, said = _connect_named(_Redirected(_elsewhere), [0, 1])
    assert links == [{}, {}] and errors == []
    assert len(said) == 2
    assert said[0].startswith("rank 0 has no same-host link with rank 1: it did not connect")
    assert said[1].startswith("rank 1 has no same-host link with rank 0: connecting to its "
                              "socket failed: [Errno 111] Connection refused (no socket of "
                              "that name here")
    assert all(f"{ENV}=require makes this an error" in s for s in said)


def test_require_makes_a_fallback_an_error_and_keeps_the_ranks_in_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "require")
    store = _Redirected(_elsewhere)
    links, errors, said = _connect_named(store, [0, 1])
    assert links == [{}, {}] and said == []
    assert len(errors) == 2 and all(e.startswith("PipelineError: rank ") for e in errors)
    assert "rank 1 has no same-host link with rank 0: connecting to its socket failed" in (
        errors[1])
    assert f"{ENV}=require makes this an error: unset it" in errors[0]
    store.record = lambda record: record  # the next round links
    links, errors, said = _connect_named(store, [0, 1])
    assert [sorted(x) for x in links] == [[1], [0]] and errors == said == []


@pytest.mark.parametrize("raw", ["yes", "true", "2", "1 0", "REQUIRE"])
def test_the_local_p2p_setting_is_checked(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # Before: anything but "0" meant on, so a misspelt "require" silently did nothing.
    monkeypatch.setenv(ENV, raw)
    links, errors, _ = _connect_named(_Store(), [0, 1])
    assert links == [{}, {}]
    assert errors == [f"PipeConfigError: {ENV} must be one of 1 (same-host links, falling back "
                      f"to the backend with a warning), 0 (no links), require (a pair on one "
                      f"host that cannot link is an error); got {raw!r}: set one of these, or "
                      f"unset it for 1"] * 2
    monkeypatch.setenv(ENV, "1")
    assert [sorted(x) for x in _connect_all(_Store(), [0, 1])] == [[1], [0]]  # in step


class _StolenFirst(_ImpostorFirst):
    """The impostor runs as another user: it read rank 1's secret from the store (open to
    every local user) and connects first with a hello that proves it."""

    def set(self, key: str, value: str) -> None:
        if key.endswith("/host/0") and self.impostor is None:
            name = value.split("\n")[1]
            self.impostor = start_as_other(_IMPOSTOR, name, _secret_hello(value, 1).hex())
            assert self.impostor.stdout is not None
            assert self.impostor.stdout.readline() == "connected\n"
        _Store.set(self, key, value)


@other_user
def test_a_stolen_secret_used_by_another_uid_is_refused_and_the_ranks_still_link() -> None:
    store = _StolenFirst(lambda _: b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LinkFallbackWarning)
        links = _connect_all(store, [0, 1])
    assert [sorted(x) for x in links] == [[1], [0]]
    _send(links[1][0], torch.arange(8, dtype=torch.uint8))
    assert torch.equal(_recv(links[0][1], 8), torch.arange(8, dtype=torch.uint8))
    assert store.impostor_saw() == "closed"  # refused on its uid, its hello never read


# Runs as uid 65534: listens on a socket of the links' kind, prints its name and pid, then
# reports how many bytes the first connection sent it before closing.
_PLANTER = """
import os, socket
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
name = "pipeline-" + os.urandom(16).hex()
sock.bind("\\0" + name)
sock.listen(8)
print(name, os.getpid(), flush=True)
sock.settimeout(120)  # a hang guard
conn, _ = sock.accept()
got = b""
conn.settimeout(120)
while chunk := conn.recv(4096):
    got += chunk
print(len(got), flush=True)
"""


@other_user
def test_a_record_planted_by_another_uid_lets_it_in_nowhere_and_stalls_nothing() -> None:
    # Anyone local can write the store: here rank 1 reads, as rank 0's address, a record
    # another user planted, naming that user's own socket and pid and a secret it chose.
    # Rank 1 refuses the socket on its uid before sending a byte; the pair warns and falls
    # back at once (not at the timeout), and the next round links.
    planter = start_as_other(_PLANTER)
    assert planter.stdout is not None
    name, pid = planter.stdout.readline().split()
    try:
        planted = lambda record: "\n".join(  # noqa: E731
            [record.split("\n")[0], name, pid, "1:" + "ab" * 32])
        store = _Redirected(planted)
        links, errors, said = _connect_named(store, [0, 1], timeout=600)
        assert links == [{}, {}] and errors == []
        assert any(s.startswith("rank 1 has no same-host link with rank 0: connecting to "
                                "its socket failed: the peer runs as uid 65534") for s in said)
        assert planter.stdout.readline().strip() == "0"  # not even the hello reached it
        store.record = lambda record: record
        assert [sorted(x) for x in _connect_all(store, [0, 1])] == [[1], [0]]
    finally:
        planter.kill()
        planter.wait()


@pytest.mark.parametrize("planted", [
    "garbage", "a\nb\nc\nd", "host\npipeline-x\nnot-a-pid\n", "host\npipeline-x\n1\n1:zz",
    "\n\n\n\n\n", "host\n\0pipeline-x\n1\n",
])
def test_a_malformed_record_in_the_store_is_a_warning_not_a_crash(planted: str) -> None:
    # Before: a raw ValueError out of the transport's construction on rank 1.
    links, errors, said = _connect_named(_Redirected(lambda _: planted), [0, 1])
    assert links == [{}, {}] and errors == []
    assert "rank 1 has no same-host link with rank 0: its record in the store is malformed" in (
        " ".join(said))


def test_a_planted_dial_announcement_holds_the_listener_only_briefly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 reads that rank 1 dialed it (planted: rank 1 could not). A real caller connects
    # and says hello before it announces its dial, so rank 0 waits PROVE seconds for it, not
    # the whole timeout (600 s here: the test's own timeout would end it first).
    monkeypatch.setattr("pipeline.comm.listener.PROVE", 0.5)

    class Planted(_Redirected):
        def get(self, key: str) -> bytes:
            return b"0" if key.endswith("/dialed/1") else super().get(key)

    links, errors, said = _connect_named(Planted(lambda _: "garbage"), [0, 1], timeout=600)
    assert links == [{}, {}] and errors == []
    assert any(s.startswith("rank 0 has no same-host link with rank 1: rank 1 announced its "
                            "dial but no connection of it proved itself in time") for s in said)


# Runs as this user, in another job: listens on a socket of the links' kind, prints its name
# and pid, then relays its first connection to the socket named argv[1] and reports how many
# bytes came back from there.
_RELAY = """
import os, socket, sys, threading
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
name = "pipeline-" + os.urandom(16).hex()
sock.bind("\\0" + name)
sock.listen(8)
print(name, os.getpid(), flush=True)
sock.settimeout(120)  # a hang guard
near, _ = sock.accept()
far = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
far.connect("\\0" + sys.argv[1])
back = []
def pipe(a, b, kept):
    try:
        while chunk := a.recv(65536):
            kept.append(len(chunk))
            b.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
thread = threading.Thread(target=pipe, args=(far, near, back))
thread.start()
pipe(near, far, [])
thread.join(120)
print(sum(back), flush=True)
"""


def test_a_relay_of_our_own_uid_in_another_job_is_refused_on_its_pid() -> None:
    # A process of this user in another job plants, as rank 0's address, its own socket and
    # its own pid (the store is open to it), keeping rank 0's secrets, and relays what comes
    # to rank 0's real socket. The uid check passes at both ends; rank 1 takes the relay for
    # rank 0 (the pid planted), but rank 0 sees the relay's pid, not the one rank 1
    # announced, and refuses it before a byte of data: the pair falls back with a warning,
    # and nothing came back through the relay.
    relays: list[subprocess.Popen[str]] = []

    def planted(record: str) -> str:
        host, name, _, secrets = record.split("\n")
        relay = subprocess.Popen([sys.executable, "-c", _RELAY, name], stdout=subprocess.PIPE,
                                 text=True)
        relays.append(relay)
        assert relay.stdout is not None
        relay_name, relay_pid = relay.stdout.readline().split()
        return "\n".join([host, relay_name, relay_pid, secrets])

    try:
        links, errors, said = _connect_named(_Redirected(planted), [0, 1], timeout=10)
        assert links == [{}, {}] and errors == []
        assert any(s.startswith("rank 0 has no same-host link with rank 1: a connection "
                                "claiming rank 1 was refused: the peer is pid ") and
                   "the pid the rank announced" in s for s in said), said
        assert any(s.startswith("rank 1 has no same-host link with rank 0") for s in said), said
        assert len(relays) == 1 and relays[0].stdout is not None
        assert relays[0].stdout.readline().strip() == "0"  # rank 0 answered it nothing
    finally:
        for relay in relays:
            relay.kill()
            relay.wait()
