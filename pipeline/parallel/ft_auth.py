"""Only the job's own processes in a replica job: its secret, and where its servers bind.

torchft's lighthouse forms a quorum from whoever asks it, and its managers serve whoever calls
them: another local user running torchft's own `ManagerServer` joined a job's quorum claiming
step 10**6 and every rank healed from it, and ended ranks through the lighthouse's dashboard
and the managers' `Kill`. This library replaces those pieces (ft_coord: the lighthouse and the
job's record; ft_manager: each group's manager; ft_transport: heals), and every one of them
proves the job's secret at both ends of each connection (ft_wire):

- the secret is `PIPELINE_FT_SECRET` (64 hex digits), made by the launcher and handed to its
  groups in their environment;
- every server binds loopback, or the interface `PIPELINE_FT_BIND` names for replicas on
  several hosts (`bind_host`), never every interface.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import PipeConfigError

__all__ = ["BIND_ENV", "SECRET_ENV", "bind_host", "build_manager", "host_port", "job_secret",
           "job_secret_env", "signer"]

SECRET_ENV = "PIPELINE_FT_SECRET"
BIND_ENV = "PIPELINE_FT_BIND"
_SECRET_HEX = 64  # 32 bytes, as the launcher makes it
_LOOPBACK = "127.0.0.1"


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


def build_manager(**kwargs: Any) -> Any:
    """torchft's Manager built with `kwargs`, its server and clients this library's
    (ft_manager: bound as `bind_host` says, both ends proving the job's secret)."""
    import torchft.manager as torchft_manager

    from pipeline.parallel.ft_manager import install

    install()
    return torchft_manager.Manager(**kwargs)
