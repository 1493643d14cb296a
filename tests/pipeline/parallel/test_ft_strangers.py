"""Heals closed to strangers and relays: checkpoint fetches travel under the job's mutual TLS,
each request names its source and is single-use, the heal server binds loopback, and a heal
read has one deadline and a size bound (the lighthouse and the managers: test_ft_coord.py;
relays of those: test_ft_relay.py)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import PipeConfigError
from tests.other_user import other_user, start_as_other

pytest.importorskip("torchft")

from pipeline.replicas import auth as ft_auth
from pipeline.replicas import tls as ft_tls
from pipeline.replicas.heal_transport import HealRefused, HealTransport
from tests.pipeline.parallel.conftest import JOB_PEM, Relay

JOB = ft_tls.JobTLS(JOB_PEM)
WAIT = timedelta(seconds=10)


def _state(step: int, value: float = 1.0) -> dict[str, Any]:
    """What torchft's Manager sends in a heal: the user's state and its own step count."""
    return {"user": {"pipe": {"w": torch.full((3,), value)}},
            "torchft": {"step": step, "batches_committed": 2 * step}}


@pytest.fixture
def source() -> Iterator[HealTransport]:
    transport = HealTransport(WAIT, tls=JOB)
    yield transport
    transport.shutdown()


@pytest.fixture
def healing() -> Iterator[HealTransport]:
    transport = HealTransport(WAIT, tls=JOB)
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
def _logged(caplog: pytest.LogCaptureFixture, text: str, times: int = 1) -> bool:
    """Whether `text` is logged `times` times within 10 s: a source logs a refusal from its
    server's thread, which may still be at it when the refused client has returned (the
    check once ran before it, on a loaded machine)."""
    deadline = time.monotonic() + 10
    while caplog.text.count(text) < times and time.monotonic() < deadline:
        time.sleep(0.05)
    return caplog.text.count(text) >= times


def test_a_heal_between_the_jobs_ranks_carries_the_state(source: HealTransport,
                                                         healing: HealTransport) -> None:
    source.send_checkpoint([1], 5, _state(5, 2.0), WAIT)
    got = healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    assert got["torchft"] == {"step": 5, "batches_committed": 10}
    assert torch.equal(got["user"]["pipe"]["w"], torch.full((3,), 2.0))


def test_the_heal_server_binds_loopback(source: HealTransport) -> None:
    """torchft binds its checkpoint server to every interface (`[::]`): another user fetched
    a checkpoint over the host's address."""
    port = int(source.metadata().split(":")[2].split("/")[0])
    assert _listening(port) == {"127.0.0.1"}


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


def test_a_process_of_another_job_is_refused_both_ways_and_logged(
        source: HealTransport, caplog: pytest.LogCaptureFixture) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    other_job = HealTransport(WAIT, tls=ft_tls.JobTLS(ft_tls.make_job_cert()))
    try:
        with pytest.raises(HealRefused, match="not one of the job's processes"):
            other_job.recv_checkpoint(0, source.metadata(), 5, WAIT)
        other_job.send_checkpoint([1], 5, _state(5, 6.0), WAIT)
        healing = HealTransport(WAIT, tls=JOB)
        with pytest.raises(HealRefused, match="not one of the job's processes"):
            healing.recv_checkpoint(0, other_job.metadata(), 5, WAIT)
        healing.shutdown()
    finally:
        other_job.shutdown()
    assert _logged(caplog, "refused a checkpoint request from 127.0.0.1: not one of the job's")


def test_the_source_must_hold_the_quorums_step(source: HealTransport,
                                               healing: HealTransport) -> None:
    """A quorum claiming step 10**6 (a stranger's claim) heals nothing: the job's source
    holds its own step, and the step count would have been forged."""
    source.send_checkpoint([1], 10**6, _state(12), WAIT)
    with pytest.raises(HealRefused, match=r"holds step 12, not the quorum's step 1000000"):
        healing.recv_checkpoint(0, source.metadata(), 10**6, WAIT)


# -- relays, replays, and a source other than the one named ------------------------------------
def test_a_relayed_heal_reads_nothing_and_changes_nothing(
        source: HealTransport, healing: HealTransport, relay: type[Relay],
        monkeypatch: pytest.MonkeyPatch) -> None:
    marker = torch.tensor([1234.5678, 8765.4321])
    state = _state(5)
    state["user"]["pipe"]["marker"] = marker
    state["user"]["pipe"]["big"] = torch.ones(1 << 14)  # the answer spans many records
    source.send_checkpoint([1], 5, state, WAIT)
    middle = relay(int(source.source.rsplit(":", 1)[1]))
    # A source that answers at the relay's address (as behind a forwarded port): the heal
    # goes through, and the relay saw none of it.
    monkeypatch.setattr(source, "source", f"127.0.0.1:{middle.port}")
    at = f"https://127.0.0.1:{middle.port}/checkpoint/"
    got = healing.recv_checkpoint(0, at, 5, WAIT)
    assert torch.equal(got["user"]["pipe"]["marker"], marker)
    for clear in (marker.numpy().tobytes(), b"/checkpoint/", b"nonce=", b"HTTP/1"):
        assert clear not in middle.seen, clear
    # A bit changed in the request, or in the answer, once the handshake is done (a heal's
    # connections carry as many bytes each time, to a few of a signature's length).
    sizes = middle.streams[0]
    for way, offset in (("up", sizes["up"] - 10), ("down", sizes["down"] - 1000)):
        middle.forwarded.clear()
        middle.flip_at = (way, offset)
        with pytest.raises(HealRefused, match=r"broke off|closed before|closed after"):
            healing.recv_checkpoint(0, at, 5, WAIT)
        assert middle.forwarded.is_set()


def test_a_heal_request_is_single_use(source: HealTransport, healing: HealTransport,
                                      relay: type[Relay], monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    state = _state(5, 3.0)
    state["user"]["pipe"]["big"] = torch.ones(1 << 14)
    source.send_checkpoint([1], 5, state, WAIT)
    # The same bytes again on a new connection (a captured request, replayed): no answer
    # (the start of a handshake, which the replayed bytes then fail).
    middle = relay(int(source.source.rsplit(":", 1)[1]))
    monkeypatch.setattr(source, "source", f"127.0.0.1:{middle.port}")
    healing.recv_checkpoint(0, f"https://127.0.0.1:{middle.port}/checkpoint/", 5, WAIT)
    payload = source._serve(5)
    with socket.create_connection(("127.0.0.1", middle.target), timeout=10) as again:
        again.sendall(bytes(middle.up))
        got = b""
        try:
            while chunk := again.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            pass
    assert len(got) < len(payload) // 8, len(got)
    assert _logged(caplog, "not one of the job's processes")
    # The same request again from one of the job's own processes: its nonce was used.
    monkeypatch.undo()
    url = f"{source.metadata()}5/full?nonce={'ab' * 16}&source={source.source}"
    assert healing._load(url, time.monotonic() + 10)["torchft"]["step"] == 5
    with pytest.raises(HealRefused, match=r"answered 409: request abab.* was served already"):
        healing._load(url, time.monotonic() + 10)
    assert _logged(caplog, "refused a checkpoint request from 127.0.0.1")


def test_a_healer_pointed_at_one_source_takes_nothing_from_another(
        source: HealTransport, healing: HealTransport, relay: type[Relay],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The quorum names source A (here the address of a relay) and the bytes reach B, one of
    the job's own processes, holding the same step: B refuses a request named for A, and the
    healer refuses an answer B gives in its own name."""
    source.send_checkpoint([1], 5, _state(5, 9.0), WAIT)
    named = relay(int(source.source.rsplit(":", 1)[1]))
    at = f"https://127.0.0.1:{named.port}/checkpoint/"
    with pytest.raises(HealRefused, match=rf"answered 421: this request is for source "
                                          rf"'127.0.0.1:{named.port}'"):
        healing.recv_checkpoint(0, at, 5, WAIT)
    monkeypatch.setattr(source, "_check", lambda nonce, source: None)  # a B that answers
    with pytest.raises(HealRefused, match=rf"X-Pipeline-Source '{source.source}', not "
                                          rf"'127.0.0.1:{named.port}'"):
        healing.recv_checkpoint(0, at, 5, WAIT)


@pytest.mark.parametrize("field", ["nonce=%C3%A9" + "a" * 31, "nonce=" + "é" * 32,
                                   "nonce=" + "A" * 32, "nonce=", "step=\uff15"])
def test_a_malformed_request_field_is_refused_by_name(source: HealTransport,
                                                      healing: HealTransport,
                                                      field: str) -> None:
    """A non-ASCII `proof=` made the source's handler raise TypeError (a traceback, the
    connection dropped); every field is checked and refused by name."""
    source.send_checkpoint([1], 5, _state(5), WAIT)
    step = "\uff15" if field.startswith("step=") else "5"  # a full-width five
    nonce = field.split("=", 1)[1] if field.startswith("nonce=") else "cd" * 16
    url = f"{source.metadata()}{step}/full?nonce={nonce}&source={source.source}"
    with pytest.raises(HealRefused, match=r"answered 400: (nonce must be 32 hex digits|only "
                                          r"/checkpoint/<step>/full)") as refused:
        healing._load(url, time.monotonic() + 10)
    assert "Traceback" not in str(refused.value)


class _Payload:
    """A pickle that would run `touch <path>` when loaded without weights_only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (subprocess.call, (["touch", self.path],))


def test_a_checkpoint_holding_code_is_refused(source: HealTransport, healing: HealTransport,
                                             tmp_path: Path) -> None:
    """The job's certificate proves who sent it, not what it holds: still read as plain
    data."""
    planted = tmp_path / "ran"
    source.send_checkpoint([1], 5, {"torchft": {"step": 5}, "x": _Payload(str(planted))}, WAIT)
    with pytest.raises(HealRefused, match=r"not plain data.*(Weights only|Unsupported)"):
        healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    assert not planted.exists()


def test_a_checkpoint_over_the_bound_is_refused_unread(source: HealTransport) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    healing = HealTransport(WAIT, tls=JOB, max_bytes=100)
    try:
        with pytest.raises(HealRefused, match=r"bytes; a heal is bounded by 100"):
            healing.recv_checkpoint(0, source.metadata(), 5, WAIT)
    finally:
        healing.shutdown()


# -- strangers as another local user -----------------------------------------------------------
# In clear, and under TLS trusting anything but with no certificate of the job's.
_FETCH = """
import ssl, sys, urllib.request
bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
for url in (sys.argv[1].replace("https:", "http:"), sys.argv[1]):
    try:
        with urllib.request.urlopen(url, timeout=20, context=bare) as f:
            print("GOT", len(f.read()))
    except Exception as e:
        print("REFUSED", type(e).__name__)
"""


@other_user
def test_a_stranger_fetching_a_checkpoint_is_refused(source: HealTransport,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    source.send_checkpoint([1], 5, _state(5), WAIT)
    url = f"{source.metadata()}5/full?nonce={'ab' * 16}&source={source.source}"
    stranger = start_as_other(_FETCH, url)
    out, err = stranger.communicate(timeout=60)
    assert [line.split()[0] for line in out.splitlines()] == ["REFUSED", "REFUSED"], (out, err)
    assert _logged(caplog, "refused a checkpoint request", times=2)
    assert caplog.text.count("refused a checkpoint request") == 2


# A heal source another user runs: it answers every request with a body of its choosing, in
# clear or with a made-up TLS-looking start.
_SOURCE = """
import socket, sys, time
mode = sys.argv[1]
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.recv(65536)
    body = b"weights of my choosing"
    head = b"\\x16\\x03\\x03" if mode == "tls" else b""
    conn.sendall(head + b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
    conn.close()
"""


@other_user
@pytest.mark.parametrize("mode", ["bare", "tls"])
def test_a_forged_heal_source_is_refused_and_logged(mode: str, healing: HealTransport,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    stranger = start_as_other(_SOURCE, mode)
    try:
        assert stranger.stdout is not None
        port = stranger.stdout.readline().strip()
        assert port.isdigit(), stranger.stderr.read() if stranger.stderr else ""
        with pytest.raises(HealRefused, match="not one of the job's processes"):
            healing.recv_checkpoint(1, f"https://127.0.0.1:{port}/checkpoint/", 5, WAIT)
    finally:
        stranger.kill()
        stranger.communicate()
    assert "heal refused, nothing applied" in caplog.text


def test_a_dripping_peer_is_cut_at_the_deadline(healing: HealTransport) -> None:
    """A byte at a time, from a process holding the job's certificate: torchft's transport
    was still reading after 30 s of a 3 s timeout (its timeout bounds each read, not the
    transfer)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn = JOB.server(listener.accept()[0], 10.0)
        conn.recv(65536)
        for b in b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100:
            if stop.wait(0.5):
                break
            conn.sendall(bytes([b]))
        conn.close()

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    began = time.monotonic()
    try:
        with pytest.raises(HealRefused, match=r"within the heal's deadline \(\d+ bytes read\)"):
            healing.recv_checkpoint(1, f"https://127.0.0.1:{listener.getsockname()[1]}"
                                       f"/checkpoint/", 5, timedelta(seconds=2))
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
    assert time.monotonic() - began < 10


def test_a_transport_shut_down_without_waiting_stops_serving() -> None:
    """torchft's Manager.shutdown(wait=False) shuts its transport down without waiting: the
    socket was closed under the serving loop, whose poll then returned at once on the dead
    descriptor, and the thread spun on a core for the rest of the process (a test process
    ran its remaining 20 minutes of tests beside it)."""
    transport = HealTransport(WAIT, tls=JOB)
    thread = transport._thread
    transport.shutdown(wait=False)
    thread.join(timeout=30)
    assert not thread.is_alive()
