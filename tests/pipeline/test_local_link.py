import socket
import threading
import time

import pytest
import torch

from pipeline.local_link import ENV, WAKE, LinkBroken, SocketLink, connect, host_key


def _pair() -> tuple[SocketLink, SocketLink]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return SocketLink(a), SocketLink(b)


def _recv(link: SocketLink, size: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype)
    link.recv_into(out, time.monotonic() + 30)
    return out


def test_messages_arrive_whole_and_in_order() -> None:
    a, b = _pair()
    sent = [torch.arange(n, dtype=torch.uint8) for n in (1, 7, 200)]
    header = torch.arange(8, dtype=torch.int64)
    works = [a.send(t) for t in sent] + [a.send(header)]
    assert all(w.done for w in works)  # small messages go in the caller's thread
    for t in sent:
        assert torch.equal(_recv(b, t.numel()), t)
    assert torch.equal(_recv(b, 8, torch.int64), header)


def test_a_message_larger_than_the_socket_buffer_never_blocks_the_sender() -> None:
    # Both ends send 32 MiB before either reads: with blocking writes this deadlocks. The part
    # the socket cannot take goes to the writer thread, in order behind nothing.
    # (A blocking send would hang here, until the test's timeout.)
    a, b = _pair()
    big = torch.randint(0, 255, (32 << 20,), dtype=torch.uint8)
    sends = [a.send(big), b.send(big.flip(0))]
    assert not sends[0].done  # returned before anything was read
    small = a.send(torch.full((3,), 9, dtype=torch.uint8))  # queued behind the big one
    assert torch.equal(_recv(b, big.numel()), big)
    assert torch.equal(_recv(b, 3), torch.full((3,), 9, dtype=torch.uint8))
    assert torch.equal(_recv(a, big.numel()), big.flip(0))
    for work in (*sends, small):
        work.wait(time.monotonic() + 30)
        assert work.done


def test_a_wait_checks_for_failures_while_nothing_arrives() -> None:
    a, _b = _pair()
    ticks: list[float] = []

    def tick(now: float) -> None:
        ticks.append(now)
        if len(ticks) == 3:
            raise RuntimeError("a failure elsewhere")

    with pytest.raises(RuntimeError, match="a failure elsewhere"):
        a.recv_into(torch.empty(4, dtype=torch.uint8), time.monotonic() + 30, tick)
    assert ticks[-1] - ticks[0] >= WAKE  # one check per WAKE, not a busy loop


def test_a_wait_times_out() -> None:
    a, _b = _pair()
    with pytest.raises(TimeoutError):
        a.recv_into(torch.empty(4, dtype=torch.uint8), time.monotonic() + 2 * WAKE)


def test_a_closed_peer_breaks_the_wait_at_once() -> None:
    a, b = _pair()
    threading.Timer(0.2, b.close).start()
    with pytest.raises(LinkBroken, match="closed"):  # not the TimeoutError of the deadline
        a.recv_into(torch.empty(4, dtype=torch.uint8), time.monotonic() + 30)
    with pytest.raises(LinkBroken):
        for _ in range(100):  # the kernel reports the broken pipe on a later write
            a.send(torch.zeros(1 << 16, dtype=torch.uint8))


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


def test_connect_links_every_pair_on_one_host() -> None:
    links = _connect_all(_Store(), [0, 1, 2])
    assert [sorted(x) for x in links] == [[1, 2], [0, 2], [0, 1]]
    msg = torch.arange(5, dtype=torch.uint8)
    links[2][0].send(msg)
    assert torch.equal(_recv(links[0][2], 5), msg)


def test_connect_leaves_ranks_on_other_hosts_to_the_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    real = host_key()
    # Rank 1 publishes another host's key: it links to nobody, and nobody to it.
    monkeypatch.setattr("pipeline.local_link.host_key",
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
    assert connect(_Store(), [0, 1], 0, timeout=1) == {}
