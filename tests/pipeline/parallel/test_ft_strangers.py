"""Heals closed to strangers: checkpoint fetches prove the job's secret at both ends, the heal
server binds loopback, and a heal read has one deadline and a size bound (the lighthouse and
the managers: test_ft_coord.py)."""

from __future__ import annotations

import subprocess
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


def test_the_heal_server_binds_loopback(source: SignedTransport) -> None:
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


def test_a_transport_shut_down_without_waiting_stops_serving() -> None:
    """torchft's Manager.shutdown(wait=False) shuts its transport down without waiting: the
    socket was closed under the serving loop, whose poll then returned at once on the dead
    descriptor, and the thread spun on a core for the rest of the process (a test process
    ran its remaining 20 minutes of tests beside it)."""
    transport = SignedTransport(WAIT, secret=SECRET)
    thread = transport._thread
    transport.shutdown(wait=False)
    thread.join(timeout=30)
    assert not thread.is_alive()
