"""Only the job's own processes in a replica job: where its servers bind, and its manager.

torchft's lighthouse forms a quorum from whoever asks it, and its managers serve whoever calls
them: another local user running torchft's own `ManagerServer` joined a job's quorum claiming
step 10**6 and every rank healed from it, and ended ranks through the lighthouse's dashboard
and the managers' `Kill`. This library replaces those pieces (coordinator: the lighthouse and the
job's record; manager: each group's manager; heal_transport: heals), and every connection
between them is mutual TLS under the job's certificate (tls, wire). Every server binds
loopback, or the interface `PIPELINE_FT_BIND` names for replicas on several hosts
(`bind_host`), never every interface.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import PipeConfigError

__all__ = ["BIND_ENV", "bind_host", "build_manager", "host_port"]

BIND_ENV = "PIPELINE_FT_BIND"
_LOOPBACK = "127.0.0.1"


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
    (manager: bound as `bind_host` says, under the job's TLS)."""
    import torchft.manager as torchft_manager

    from pipeline.replicas.manager import install

    install()
    return torchft_manager.Manager(**kwargs)
