"""Only the job's own processes in a replica quorum: its secret, loopback servers, signed members.

torchft's lighthouse forms a quorum from whoever asks it, and its managers serve whoever calls
them: another local user running torchft's own `ManagerServer` joined a job's quorum claiming
step 10**6 and every rank healed from it. torchft has no hook for either, so this module wraps
its pieces from the outside:

- the job's secret (`PIPELINE_FT_SECRET`, 64 hex digits, made by the launcher and handed to
  its groups in their environment) keys every proof below;
- each Manager's `ManagerServer` is built with its `bind` rewritten to loopback (or to the
  interface `PIPELINE_FT_BIND` names, for replicas on several hosts), instead of `[::]`;
- the Manager's `ManagerClient` is replaced by `QuorumGate`, whose `_quorum` passes a quorum
  on only when every participant signed, for this quorum, what it claims (its replica id, its
  step, its manager's and store's addresses: `member_mac`) in the job's record store (or, with
  no launcher, the quorum's own store). A stranger cannot sign, so a quorum holding one is
  refused before anything is healed, sent or averaged, and asked again; still refused when the
  quorum's deadline passes, it raises `QuorumRefused`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import PipeConfigError, PipelineError

__all__ = ["BIND_ENV", "SECRET_ENV", "Member", "QuorumGate", "QuorumRefused", "bind_host",
           "build_manager", "host_port", "job_secret", "job_secret_env", "signer"]

_log = logging.getLogger(__name__)

SECRET_ENV = "PIPELINE_FT_SECRET"
BIND_ENV = "PIPELINE_FT_BIND"
_SECRET_HEX = 64  # 32 bytes, as the launcher makes it
_LOOPBACK = "127.0.0.1"
# How long a quorum's members get to sign it: each signs as soon as the lighthouse answers it,
# so this is slack for a loaded host; a stranger's missing entry costs a quorum this long.
ENTRY_WAIT_S = 10.0
_RETRY_S = 0.5  # between a refused quorum and the next request
_ENTRIES = "pipeline/ft/member"  # keys: <prefix>/<quorum id>/<group rank>/<replica id>
_VOTES = "pipeline/ft/vote"  # keys: <prefix>/<replica id>/<round>/<group rank>
_server_lock = threading.Lock()  # one Manager built with the wrapped ManagerServer at a time


class QuorumRefused(PipelineError):
    """A quorum held a participant that did not prove the job's secret."""


def job_secret_env() -> dict[str, str]:
    """A fresh secret for one job, as the environment its replica groups get."""
    return {SECRET_ENV: secrets.token_hex(_SECRET_HEX // 2)}


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from `PIPELINE_FT_SECRET` (None when unset or empty: nothing is
    authenticated then, as in torchft)."""
    raw = (os.environ if environ is None else environ).get(SECRET_ENV, "").strip()
    if not raw:
        return None
    try:
        value = bytes.fromhex(raw)
    except ValueError:
        value = b""
    if len(value) * 2 != _SECRET_HEX:
        # The value itself is never shown: it is the job's key.
        raise PipeConfigError(
            f"{SECRET_ENV} must be {_SECRET_HEX} hex digits (32 bytes), the same in every "
            f"replica group; got {len(raw)} characters{'' if value else ' (not hex)'}: let "
            f"`python -m pipeline.launch --replicas` make it, or export the output of "
            f"`python -c 'import secrets; print(secrets.token_hex(32))'` to every group")
    return value


def signer(secret: bytes | None, label: str, *fields: object) -> hmac.HMAC:
    """An HMAC-SHA256 over `label` and `fields` (each length-prefixed: no two field lists
    encode alike), ready for more bytes. With no secret the key is empty: a check that
    anyone passes, so that a job without one runs as before."""
    mac = hmac.new(secret or b"", b"pipeline-ft\0" + label.encode(), hashlib.sha256)
    for f in fields:
        raw = str(f).encode()
        mac.update(len(raw).to_bytes(4, "little") + raw)
    return mac


def bind_host(lighthouse: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The address this rank's servers bind and advertise: loopback, or `PIPELINE_FT_BIND`
    (an IP address of this host's interface that the other hosts' replicas reach). Unset with
    a lighthouse on another host, the job spans hosts: an error says to name one."""
    raw = (os.environ if environ is None else environ).get(BIND_ENV, "").strip()
    if not raw:
        host = urlsplit(lighthouse).hostname if lighthouse else None
        if host is not None and host != "localhost" and not _is_loopback(host):
            raise PipeConfigError(
                f"the lighthouse is at {lighthouse!r}, not on this host's loopback, so the "
                f"replicas span hosts, and their servers bind loopback unless {BIND_ENV} "
                f"names this host's address on the network they share: set {BIND_ENV}="
                f"<that address> (docs/security.md), or {BIND_ENV}=127.0.0.1 if every "
                f"replica runs here")
        return _LOOPBACK
    try:
        address = ipaddress.ip_address(raw)
    except ValueError:
        address = None
    if address is None or address.is_unspecified:
        raise PipeConfigError(
            f"{BIND_ENV} must be an IP address of this host's interface that the replicas "
            f"reach each other on (not a name, not 0.0.0.0 or ::); got {raw!r}: set it so, or "
            f"unset it for loopback (every replica on this host)")
    return str(address)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int | str) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextlib.contextmanager
def _servers_bound(host: str) -> Iterator[None]:
    """While a Manager is built: its ManagerServer binds `host` (torchft binds `[::]`, every
    interface) and advertises it to the lighthouse (torchft: the host's name)."""
    import torchft.manager as torchft_manager

    real = torchft_manager.ManagerServer

    def server(*, bind: str, hostname: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        # The advertised name goes into "http://<hostname>:<port>" (an IPv6 one bracketed).
        return real(bind=host_port(host, port), hostname=f"[{host}]" if ":" in host else host,
                    **kwargs)

    with _server_lock:
        torchft_manager.ManagerServer = server
        try:
            yield
        finally:
            torchft_manager.ManagerServer = real


def build_manager(*, secret: bytes | None, record_store: Any, **kwargs: Any) -> Any:
    """torchft's Manager built with `kwargs`, its server bound as `bind_host` says and, with
    a secret, its quorums passed through a QuorumGate (entries in `record_store`, or in each
    quorum's own store when None)."""
    import torchft.manager as torchft_manager

    with _servers_bound(bind_host(kwargs.get("lighthouse_addr"))):
        manager = torchft_manager.Manager(**kwargs)
    client = getattr(manager, "_client", None)  # a stand-in Manager in tests has none
    if secret is not None and client is not None:
        store = manager._store
        me = Member(replica_id=store.get(torchft_manager.REPLICA_ID_KEY).decode(),
                    manager_address=store.get(torchft_manager.MANAGER_ADDR_KEY).decode(),
                    store_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        manager._client = QuorumGate(client, secret=secret, me=me,
                                     group_rank=manager._group_rank, store=record_store,
                                     world_size=manager._group_world_size)
    return manager


@dataclass(frozen=True)
class Member:
    """What one replica group says of itself in a quorum (torchft's QuorumMember)."""

    replica_id: str  # "<name>:<uuid>", fresh for each start of the group
    manager_address: str  # where a healing peer asks for this group's checkpoint
    store_address: str  # this group's store, where a quorum's process group may meet

    def entry(self, secret: bytes, quorum_id: int, group_rank: int, step: int) -> str:
        mac = member_mac(secret, quorum_id, group_rank, step, self)
        return f"{step} {self.manager_address} {self.store_address} {mac}"


def member_mac(secret: bytes, quorum_id: int, group_rank: int, step: int,
               member: Member) -> str:
    return signer(secret, "member", quorum_id, group_rank, member.replica_id, step,
                  member.manager_address, member.store_address).hexdigest()


class QuorumGate:
    """torchft's ManagerClient, its quorums passed on only when every participant proved the
    job's secret for this quorum; every other call goes to the client unchanged."""

    def __init__(self, client: Any, *, secret: bytes, me: Member, group_rank: int,
                 store: Any = None, world_size: int = 1,
                 entry_wait: float = ENTRY_WAIT_S) -> None:
        self._client, self._secret, self._me = client, secret, me
        self._group_rank, self._store, self._entry_wait = group_rank, store, entry_wait
        self._world_size = world_size
        self._stores: dict[str, Any] = {}  # quorum store address -> client (no record)
        self._refused: tuple[int, str] | None = None  # the last refusal logged
        self._rounds = 0  # should_commit calls so far: every rank of the group makes each

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **kwargs: Any) -> Any:
        """torchft's quorum call (as `Manager._async_quorum` makes it), asked again while a
        quorum holds a stranger; QuorumRefused once `timeout` passes."""
        timeout: timedelta = kwargs["timeout"]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = max(0.001, deadline - time.monotonic())
            quorum = self._client._quorum(**{**kwargs, "timeout": timedelta(seconds=left)})
            why = self._check(quorum, int(kwargs["step"]), deadline)
            if why is None:
                return quorum
            if self._refused != (quorum.quorum_id, why):
                self._refused = (quorum.quorum_id, why)
                _log.warning("quorum %d refused (nothing healed, sent or averaged): %s",
                             quorum.quorum_id, why)
            if time.monotonic() >= deadline:
                raise QuorumRefused(
                    f"no quorum in {timeout.total_seconds():g}s had only participants that "
                    f"prove the job's secret (last: quorum {quorum.quorum_id}: {why}); another "
                    f"process joins the job's lighthouse or disturbs its record "
                    f"(docs/security.md): run the job where other users cannot reach it")
            time.sleep(_RETRY_S)

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: timedelta) -> bool:
        """torchft's vote of the group's ranks, True only when each rank also signed a yes.
        The manager counts one vote per group rank from whoever calls it: another process's
        yes, cast for a rank before that rank's own no, made the group commit a step that
        rank refused (a forged heal, a torn average)."""
        decision = bool(self._client.should_commit(group_rank, step, should_commit,
                                                   timeout=timeout))
        store = self._votes_store()
        self._rounds += 1
        prefix = f"{_VOTES}/{self._me.replica_id}/"
        vote = "1" if should_commit else "0"
        mac = signer(self._secret, "vote", self._me.replica_id, self._rounds, group_rank,
                     step, vote).hexdigest()
        store.set(f"{prefix}{self._rounds}/{group_rank}", f"{vote} {mac}")
        if self._rounds > 2:  # read by every rank by now: each rank is past that round
            store.delete_key(f"{prefix}{self._rounds - 2}/{group_rank}")
        if not decision:
            return False
        until = time.monotonic() + min(self._entry_wait, timeout.total_seconds())
        while True:
            noes = [r for r in range(self._world_size)
                    if not self._voted_yes(store, prefix, r, step)]
            if not noes or time.monotonic() >= until:
                break
            time.sleep(0.02)
        if noes:
            _log.warning("step %d not committed: group rank(s) %s signed no yes to it (a "
                         "vote another process cast for them was counted)", step, noes)
        return not noes

    def _voted_yes(self, store: Any, prefix: str, rank: int, step: int) -> bool:
        key = f"{prefix}{self._rounds}/{rank}"
        if not store.check([key]):
            return False
        vote, _, mac = store.get(key).decode(errors="replace").partition(" ")
        want = signer(self._secret, "vote", self._me.replica_id, self._rounds, rank, step,
                      vote).hexdigest()
        return vote == "1" and hmac.compare_digest(mac, want)

    def _votes_store(self) -> Any:
        """Where the group's ranks sign their votes: the record, or the group's own store."""
        if self._store is not None:
            return self._store
        return self._client_of(self._me.store_address)

    def _check(self, quorum: Any, step: int, deadline: float) -> str | None:
        """Why `quorum` is refused, or None: this rank signs it, then waits (up to the entry
        wait) for every participant's signature of the same quorum."""
        until = min(deadline, time.monotonic() + self._entry_wait)
        prefix = f"{_ENTRIES}/{quorum.quorum_id}/{self._group_rank}/"
        try:
            # With no record, the quorum's store: a stranger that made itself the quorum's
            # primary names its own, which holds no entry of ours or fails here.
            store = self._store if self._store is not None else self._client_of(
                quorum.store_address)
            store.set(prefix + self._me.replica_id,
                      self._me.entry(self._secret, quorum.quorum_id, self._group_rank, step))
            while True:
                why = self._verify(quorum, store, prefix)
                # A peer's entry may not be written yet, or hold its previous step: wait.
                if why is None or time.monotonic() >= until:
                    return why
                time.sleep(0.05)
        except Exception as exc:  # the store broke off or never answered
            self._stores.pop(quorum.store_address, None)
            return f"the store of the entries failed ({type(exc).__name__}: {exc})"

    def _verify(self, quorum: Any, store: Any, prefix: str) -> str | None:
        signed: list[tuple[int, Member]] = []
        for rid in quorum.replica_ids:
            if not store.check([prefix + rid]):
                return f"participant {rid!r} signed no entry: it does not hold the job's secret"
            fields = store.get(prefix + rid).decode(errors="replace").split(" ")
            member = (Member(rid, fields[1], fields[2]) if len(fields) == 4
                      and fields[0].lstrip("-").isdigit() else None)
            if member is None or not hmac.compare_digest(
                    fields[3], member_mac(self._secret, quorum.quorum_id, self._group_rank,
                                          int(fields[0]), member)):
                return f"the entry of participant {rid!r} does not prove the job's secret"
            signed.append((int(fields[0]), member))
        tops = [m for s, m in signed if s == quorum.max_step]
        if not tops:
            return (f"the quorum's step {quorum.max_step} is no participant's signed step "
                    f"({sorted(s for s, _ in signed)})")
        if quorum.heal and quorum.recover_src_manager_address not in {
                m.manager_address for m in tops}:
            return (f"the heal source {quorum.recover_src_manager_address!r} is no signed "
                    f"participant's manager at step {quorum.max_step}")
        if quorum.store_address not in {m.store_address for m in tops}:
            return f"the quorum's store {quorum.store_address!r} is no signed participant's"
        return None

    def _client_of(self, address: str) -> Any:
        """A client of the store at `address` (a quorum's, where its process group meets: the
        entries' place when no launcher keeps a record)."""
        if address not in self._stores:
            from torch._C._distributed_c10d import TCPStore

            host, _, port = address.rpartition(":")
            self._stores[address] = TCPStore(host.strip("[]"), int(port), None, False,
                                             timedelta(seconds=self._entry_wait))
        return self._stores[address]
