"""Same-host links: how two process ranks of one machine get a Unix socket, and who may use it.

`connect` sets the links up through the rendezvous store, lets only the pair's own processes
in (link_auth: peer credentials and a per-pair secret; listener: connections taken from the
moment the socket exists) and agrees with each peer whether its link works. Ranks on other
hosts, ranks whose links are off (`PIPELINE_LOCAL_P2P=0`) and other platforms use the
process group's backend. A pair on this host that fails to link falls back to the backend
too, with a `LinkFallbackWarning` saying why (containers that share a host name but not a
network namespace, a full backlog until the deadline, a record that fails the checks), or
with a `PipelineError` under `PIPELINE_LOCAL_P2P=require`. The link itself: socket_link.py.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from pipeline import settings
from pipeline.comm import link_auth
from pipeline.comm.listener import Listener
from pipeline.comm.socket_link import (
    SPIN,
    SPIN_ENV,
    WAKE,
    LinkBroken,
    LinkSend,
    SocketLink,
    spin_setting,
    spin_time,
)
from pipeline.errors import PipelineError

__all__ = ["ENV", "MODES", "SPIN", "SPIN_ENV", "WAKE", "LinkBroken", "LinkFallbackWarning",
           "LinkSend", "SocketLink", "connect", "host_key", "local_p2p", "spin_setting",
           "spin_time"]

ENV = "PIPELINE_LOCAL_P2P"
# "1" (the default): links where they work, a warning where a pair on this host falls back;
# "0": same-host ranks talk over the process group's backend too; "require": a pair on this
# host that cannot link is an error (a fall back can cost a latency-bound job several times).
MODES = ("1", "0", "require")
# Per (group, rank): links set up so far, the same count on every rank of a group.
_instances: dict[tuple[str, int], int] = {}
_RETRY = 0.05  # the longest pause between connects a full backlog refused (EAGAIN)


class LinkFallbackWarning(RuntimeWarning):
    """Two ranks on this host talk over the process group's backend: their link failed."""


def local_p2p() -> str:
    """`PIPELINE_LOCAL_P2P`, checked: one of `MODES`."""
    return settings.choice(ENV, {
        "1": "same-host links, falling back to the backend with a warning",
        "0": "no links",
        "require": "a pair on one host that cannot link is an error"}, default="1")


def host_key() -> str:
    """What two processes on one machine (booted once) share and others do not."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def connect(store: Any, ranks: list[int], me: int, timeout: float) -> dict[int, SocketLink]:
    """Links from rank `me` to every peer of `ranks` (global ranks, indexed by group rank) on
    this host, by group rank. Every rank of the group calls it (transport construction is
    collective); each pair agrees through `store` whether its link works, and only the pair's
    own processes can use it (see link_auth).

    Every call takes the next round of keys, whatever happens: a rank whose links are off, or
    whose setup fails, still publishes an empty record for each step of the round, so its
    peers finish the round without a link to it and every rank's next round is the same."""
    if store is None or len(ranks) < 2:
        return {}
    group = "-".join(map(str, ranks))
    _instances[group, me] = number = _instances.get((group, me), 0) + 1
    prefix = f"pipeline/link/{group}/{number}/"
    steps = ("host", "dialed", "linked")
    published: set[str] = set()

    def publish(step: str, value: str) -> None:
        store.set(f"{prefix}{step}/{me}", value)
        published.add(step)

    socks: dict[int, socket.socket] = {}
    try:
        mode = local_p2p()
        if mode == "0" or not sys.platform.startswith("linux"):
            publish("host", "")  # links are off here: peers leave this rank to the backend
            return {}
        links, why = _connect(store, len(ranks), me, timeout, prefix, publish, socks,
                              spin_setting())
    except BaseException:
        for sock in socks.values():
            sock.close()
        with contextlib.suppress(Exception):  # best effort: the store may be what failed
            for step in steps:
                if step not in published:
                    publish(step, "")
        raise
    if why:
        _fall_back(why, ranks, me, links, required=mode == "require")
    return links


def _fall_back(why: dict[int, str], ranks: list[int], me: int, links: dict[int, SocketLink],
               *, required: bool) -> None:
    """Say which peers on this host fall back to the backend, and why; or refuse to."""
    lines = [f"rank {ranks[me]} has no same-host link with rank {ranks[peer]}: {reason}"
             for peer, reason in sorted(why.items())]
    if required:
        for link in links.values():
            link.close()
        raise PipelineError("; ".join(lines) + f". {ENV}=require makes this an error: unset "
                            f"it to let such pairs use the process group's backend")
    for line in lines:
        warnings.warn(f"{line}; the pair uses the process group's backend instead (slower). "
                      f"{ENV}=require makes this an error", LinkFallbackWarning, stacklevel=3)


# Abstract socket names are listed for every local user (/proc/net/unix), and anyone may
# connect to one; a socket file in a private 0700 directory would keep other users out. We
# keep abstract names and rely on the handshake instead: the kernel's SO_PEERCRED refuses
# other users before a byte is read, and a same-user process must also prove the pair's
# secret and be the pid the rank announced; the only processes it cannot keep out are ones
# of our own user, which could ptrace us anyway. Abstract names also vanish with their
# process (no stale files after a SIGKILL) and live in the network namespace, which is what
# makes containers sharing a host name but not a network namespace fall back to the backend.
def _connect(store: Any, size: int, me: int, timeout: float, prefix: str,
             publish: Callable[[str, str], None], socks: dict[int, socket.socket],
             setting: float | None) -> tuple[dict[int, SocketLink], dict[int, str]]:
    """The links of `connect`, and per peer on this host that has none, why."""
    deadline = time.monotonic() + timeout
    why: dict[int, str] = {}
    secrets = {peer: link_auth.new_secret() for peer in range(me + 1, size)}
    # Takes connections from now on, before the store is read: see listener.py.
    listener = Listener(me, secrets, deadline)
    try:
        here = host_key()
        publish("host", _record(here, listener.name, os.getpid(), secrets))
        peers: dict[int, tuple[str, int, dict[int, bytes]]] = {}  # same-host peer's record
        for peer in range(size):
            if peer != me:
                raw = store.get(f"{prefix}host/{peer}")
                try:
                    record = _parse_record(raw)
                except ValueError:
                    why[peer] = ("its record in the store is malformed (the store is open to "
                                 "every local user: see docs/security.md)")
                    continue
                if record is not None and record[0] == here:
                    peers[peer] = record[1:]
        nonces: dict[int, bytes] = {}
        for peer in (p for p in peers if p < me):  # the higher rank of a pair dials
            address, pid, theirs = peers[peer]
            try:
                if me not in theirs:
                    raise link_auth.Refused("its record holds no secret for this pair")
                sock = _dial(address, pid, deadline)
                socks[peer] = sock
                nonces[peer] = os.urandom(link_auth.NONCE)
                sock.sendall(link_auth.hello(theirs[me], me, peer, nonces[peer]))
            except OSError as exc:  # Refused too: no link with this peer
                with contextlib.suppress(KeyError):
                    socks.pop(peer).close()
                why[peer] = f"connecting to its socket failed: {_reason(exc)}"
        publish("dialed", ",".join(map(str, socks)))
        callers = {}
        for p in (p for p in peers if p > me):
            if str(me) in store.get(f"{prefix}dialed/{p}").decode(errors="replace").split(","):
                callers[p] = peers[p][1]
            else:
                why[p] = "it did not connect to this rank (its own warning says why)"
        listener.expect(callers)
        linked, refused = listener.result()
        socks.update(linked)
        why.update(refused)
    finally:
        listener.close()
    for peer in [p for p in socks if p < me]:  # the listener must prove the secret too
        try:
            socks[peer].settimeout(max(0.0, deadline - time.monotonic()))
            if not hmac.compare_digest(_read(socks[peer], link_auth.ANSWER), link_auth.answer(
                    peers[peer][2][me], peer, me, nonces[peer])):
                raise link_auth.Refused("its answer does not prove the pair's secret")
        except OSError as exc:
            socks.pop(peer).close()
            why[peer] = f"its handshake failed: {_reason(exc)}"
    publish("linked", ",".join(map(str, socks)))
    # This group's processes here, or the whole job's (torchrun and pipeline.launch say).
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = max(len(peers) + 1, int(local_world) if local_world.isdigit() else 0)
    spin = spin_time(local, setting)
    links = {}
    for peer, sock in list(socks.items()):
        if str(me) in store.get(f"{prefix}linked/{peer}").decode(errors="replace").split(","):
            links[peer] = SocketLink(sock, spin)
        else:
            sock.close()
            why[peer] = "it did not confirm the link (its own warning says why)"
        del socks[peer]
    return links, why


def _dial(address: str, pid: int, deadline: float) -> socket.socket:
    """A connection to the abstract socket `address` of process `pid`, its credentials
    checked. A full backlog (EAGAIN: a stranger may be flooding it) is retried until
    `deadline`; any other failure raises at once (ECONNREFUSED: no such socket here)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)  # a Unix connect never waits: it links or says why
        pause = 1e-3
        while True:
            try:
                sock.connect("\0" + address)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("its listen backlog stayed full until the deadline "
                                       "(another local process may be flooding it)") from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, _RETRY)
        link_auth.check_peer(sock, pid)
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
    except BaseException:
        sock.close()
        raise
    return sock


def _reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return (f"{exc} (no socket of that name here: another network namespace, as in "
                f"containers that share a host name?)")
    if isinstance(exc, link_auth.Refused | TimeoutError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _record(host: str, name: str, pid: int, secrets: dict[int, bytes]) -> str:
    """A rank's address for the store: host key, socket name, pid, and per higher peer the
    secret of the pair."""
    return "\n".join([host, name, str(pid), ",".join(f"{p}:{s.hex()}" for p, s in
                                                     secrets.items())])


def _parse_record(raw: bytes | str) -> tuple[str, str, int, dict[int, bytes]] | None:
    """A peer's record from the store; None when its links are off. Raises ValueError for one
    no rank of ours writes (anyone local can write the store)."""
    text = raw.decode() if isinstance(raw, bytes) else raw  # UnicodeDecodeError: a ValueError
    if not text:
        return None
    host, name, pid, secrets = text.split("\n")
    if not name.startswith("pipeline-") or not name.isprintable():
        raise ValueError(f"not a link's socket name: {name!r}")
    pairs = (item.split(":") for item in secrets.split(",") if item)
    return host, name, int(pid), {int(p): bytes.fromhex(s) for p, s in pairs}


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data
