"""A launch in a network namespace of its own: loopback servers no other local user can reach.

Every server a job runs on one host binds loopback: the rendezvous stores, gloo, the replica
job's lighthouse and record, each group's manager, the heal servers, and the abstract sockets
of same-host links. Loopback is open to every user of the host, and torch's stores and gloo
authenticate no one: what the job's secret cannot guard (docs/security.md), a namespace can.
`python -m pipeline.launch --private-network ...` starts the launcher again in a new user and
network namespace (the user's own uid mapped to itself, so files and peer checks see the same
owner), whose loopback only the job's processes share.

The price: the job has no network but its own loopback (a script that downloads, or logs to a
remote service, cannot), so it is for single-host jobs, and it needs unprivileged user
namespaces (off on some distributions: Ubuntu 24.04 restricts them through AppArmor).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["INSIDE_ENV", "enter", "relaunch", "unavailable"]

INSIDE_ENV = "PIPELINE_PRIVATE_NETWORK"  # set in the namespace: do not enter another
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def enter() -> None:
    """Move the calling (single-threaded) process into a new user and network namespace, its
    uid and gid mapped to themselves, with the loopback interface up. Raises OSError."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(errno)}")
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:  # the kernel's own files for this process
            f.write(text)
    # A new network namespace's loopback is down. Brought up here, while this process still
    # holds the namespace's capabilities (an exec as a non-root uid drops them).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def unavailable() -> str | None:
    """Why a private network cannot be made here (None: it can), tried in a short child."""
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=enter, check=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def relaunch(argv: Sequence[str]) -> int:
    """Run `python -m pipeline.launch argv` (without --private-network) in a private network,
    passing SIGTERM and SIGINT on to it; its exit code, or 1 with the reason when no private
    network can be made."""
    why = unavailable()
    if why is not None:
        print(f"pipeline.launch: --private-network needs unprivileged user and network "
              f"namespaces, and this host refused one ({why}); run without it, or enable them "
              f"(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 "
              f"kernel.apparmor_restrict_unprivileged_userns=0)", file=sys.stderr)
        return 1
    # The handlers before the child: a SIGTERM as it starts would otherwise end this process
    # by the default action and leave the job running without its launcher. One that comes
    # before the child exists is passed on once it does.
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not child:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(signum)

    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        child.append(subprocess.Popen([sys.executable, "-m", "pipeline.launch", *argv],
                                      env={**os.environ, INSIDE_ENV: "1"}, preexec_fn=enter))
        for signum in pending:
            with contextlib.suppress(ProcessLookupError):
                child[0].send_signal(signum)
        return child[0].wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
