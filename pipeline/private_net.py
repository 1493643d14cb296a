"""A launch in a network namespace of its own: loopback servers no other local user can reach.

Every server a job runs on one host binds loopback: the rendezvous stores, gloo, the replica
job's lighthouse and record, each group's manager, the heal servers, and the abstract sockets
of same-host links. Loopback is open to every user of the host, and torch's stores and gloo
authenticate no one: what the job's TLS certificate does not cover (docs/security.md), a
namespace can.
`python -m pipeline.launch --private-network ...` starts the launcher again in a new user and
network namespace (the user's own uid mapped to itself, so files and peer checks see the same
owner), whose loopback only the job's processes share.

It fails closed. The launcher inside knows it is inside by a mark only the launcher outside
can give: a pipe it inherits (named by `INSIDE_ENV`, with the pipe's own identity) holding
the outer network namespace's identity, which must differ from its own. A variable alone, left
in an environment or passed on to a job's processes, never skips the namespace; a launcher
marked but still in the host's namespace refuses to run. A refused namespace is named by the
kernel's errno and by this kernel's settings that govern it (`refusal`).

The price: the job has no network but its own loopback (a script that downloads, or logs to a
remote service, cannot), so it is for single-host jobs, and it needs unprivileged user
namespaces (off on some distributions: Ubuntu 24.04 restricts them through AppArmor).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence

__all__ = ["INSIDE_ENV", "SYSCTL", "NotPrivate", "enter", "inside", "refusal", "relaunch",
           "unavailable"]

INSIDE_ENV = "PIPELINE_PRIVATE_NETWORK"  # "fd:dev:inode" of the mark's pipe (see `inside`)
SYSCTL = "/proc/sys"
_UNSHARE = "unshare(CLONE_NEWUSER | CLONE_NEWNET)"
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_NETNS = "/proc/self/ns/net"


class NotPrivate(RuntimeError):
    """A launcher marked as started in a private network is in its starter's namespace."""


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def enter() -> None:
    """Move the calling (single-threaded) process into a new user and network namespace, its
    uid and gid mapped to themselves, with the loopback interface up. Raises OSError whose
    filename is the step the kernel refused."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, _UNSHARE) from None
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:  # the kernel's own files for this process
            f.write(text)
    # A new network namespace's loopback is down. Brought up here, while this process still
    # holds the namespace's capabilities (an exec as a non-root uid drops them).
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sh22x", b"lo", 0)
            flags = struct.unpack("16sh22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, "bringing the loopback interface up") from None


# The settings that govern a refusal, where a kernel has them: the limits on namespaces a
# user may hold (ENOSPC), and the switches some distributions add (EPERM), with the value
# that forbids and the value that allows.
_LIMITS = ("user.max_user_namespaces", "user.max_net_namespaces")
_SWITCHES = {"kernel.unprivileged_userns_clone": ("0", "1"),
             "kernel.apparmor_restrict_unprivileged_userns": ("1", "0")}
_CAUSES = {errno.EUSERS: "namespaces are nested 32 deep, the kernel's most",
           errno.EINVAL: "this kernel was built without user or network namespaces "
                         "(CONFIG_USER_NS, CONFIG_NET_NS)",
           errno.ENOMEM: "the kernel is out of memory"}


def _setting(name: str) -> str | None:
    """This kernel's value of sysctl `name`; None where it has no such setting."""
    try:
        with open(os.path.join(SYSCTL, *name.split(".")), encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _settings(names: Sequence[str]) -> dict[str, str]:
    return {n: v for n in names if (v := _setting(n)) is not None}


def refusal(exc: OSError) -> str:
    """A refused namespace in words: the step, the kernel's errno and reason, and the settings
    of this kernel that govern it, as they are (only settings it has are named)."""
    code = exc.errno if exc.errno is not None else 0
    head = (f"{exc.filename or 'making the namespace'} failed: "
            f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})")
    if exc.filename != _UNSHARE:  # a later step: the settings below govern unshare only
        return head
    if code == errno.ENOSPC:
        limits = "".join(f"{n} = {v}; " for n, v in _settings(_LIMITS).items())
        return (f"{head}: this user holds as many user or network namespaces as this kernel "
                f"allows, or they nest 32 deep ({limits}0 turns them off: raise one with "
                f"sysctl -w NAME=N, or end other namespaces of this user)")
    if code == errno.EPERM:
        found = _settings(list(_SWITCHES))
        forbidding = [f"{n} = {v} (sysctl -w {n}={_SWITCHES[n][1]} allows them)"
                      for n, v in found.items() if v == _SWITCHES[n][0]]
        if forbidding:
            return f"{head}: this kernel forbids unprivileged user namespaces: " + ", ".join(
                forbidding)
        shown = ", ".join(f"{n} = {v}" for n, v in found.items())
        return (f"{head}: no setting of this kernel forbids it" + (f" ({shown})" if shown else "")
                + ": a seccomp filter or a security module refuses unshare here (a "
                "container's default profile does)")
    shown = ", ".join(f"{n} = {v}" for n, v in _settings([*_LIMITS, *_SWITCHES]).items())
    cause = _CAUSES.get(code)
    return head + (f": {cause}" if cause else "") + (f" ({shown})" if shown else "")


def _start(command: Sequence[str], **options: object) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(command)` in a new namespace (`enter` before the exec); OSError
    naming the step and errno if the kernel refused it. Popen itself reports only that its
    preexec_fn raised: the child writes the errno and step to a pipe of its own first."""
    report, write_end = os.pipe()  # close-on-exec: a child that execs leaves it empty

    def preexec() -> None:
        try:
            enter()
        except OSError as exc:
            os.write(write_end, f"{exc.errno}\n{exc.filename or ''}".encode())
            raise

    try:
        try:
            child: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
                command, preexec_fn=preexec, **options)
            return child
        except subprocess.SubprocessError as exc:
            os.close(write_end)
            write_end = -1
            code, _, step = os.read(report, 4096).decode(errors="replace").partition("\n")
            if not code.isdigit():
                raise
            raise OSError(int(code), os.strerror(int(code)), step or None) from exc
    finally:
        os.close(report)
        if write_end >= 0:
            os.close(write_end)


def unavailable() -> str | None:
    """Why a private network cannot be made here (None: it can), tried in a short child."""
    try:
        child = _start([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL)
    except OSError as exc:
        return refusal(exc)
    except subprocess.SubprocessError as exc:  # no OSError: nothing more to name
        return f"{type(exc).__name__}: {exc}"
    try:
        code = child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return "a child in the new namespace did not exit within 60 s"
    return None if code == 0 else f"a child in the new namespace exited with {code}"


def _namespace() -> str:
    st = os.stat(_NETNS)
    return f"{st.st_dev}:{st.st_ino}"


def _mark() -> tuple[int, str]:
    """A pipe holding this process's network namespace's identity: its read end (for the
    child to inherit) and the value of `INSIDE_ENV` that names it."""
    read, write = os.pipe()
    with os.fdopen(write, "w") as f:
        f.write(_namespace())
    pipe = os.fstat(read)
    return read, f"{read}:{pipe.st_dev}:{pipe.st_ino}"


def inside() -> bool:
    """Whether this process is a launcher `relaunch` started in a private network: it
    inherited the very pipe `INSIDE_ENV` names, and the network namespace the pipe holds (the
    launcher's outside) is not its own. Takes the mark (the variable and the pipe) for this
    process alone. Raises `NotPrivate` if marked but still in that namespace."""
    value = os.environ.pop(INSIDE_ENV, "")
    parts = value.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return False
    fd, device, inode = map(int, parts)
    try:
        pipe = os.fstat(fd)
    except OSError:
        return False
    if not stat.S_ISFIFO(pipe.st_mode) or (pipe.st_dev, pipe.st_ino) != (device, inode):
        return False  # some other file at that number: not ours to read
    try:
        os.set_blocking(fd, False)
        outside = os.read(fd, 256).decode(errors="replace")
    except OSError:
        return False
    finally:
        os.close(fd)
    if not outside:
        return False
    if outside == _namespace():
        raise NotPrivate("it was started to run in a private network, but is in the network "
                         "namespace of the launcher that started it (the host's network "
                         "namespace): the job would share the host's loopback")
    return True


def _serve(start: Callable[[], subprocess.Popen[bytes]]) -> int:
    """Start the child, passing SIGTERM and SIGINT on to it; its exit code."""
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
        child.append(start())
        for signum in pending:
            with contextlib.suppress(ProcessLookupError):
                child[0].send_signal(signum)
        return child[0].wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _refused(why: str) -> int:
    print(f"pipeline.launch: --private-network needs unprivileged user and network "
          f"namespaces, and this host refused one ({why}); run without it, or allow them",
          file=sys.stderr)
    return 1


def relaunch(argv: Sequence[str]) -> int:
    """Run `python -m pipeline.launch argv` (argv holds --private-network: the launcher
    started knows it is inside by `inside`) in a private network, passing SIGTERM and SIGINT
    on to it; its exit code, or 1 with the reason when no private network can be made."""
    why = unavailable()
    if why is not None:
        return _refused(why)
    read, mark = _mark()

    def start() -> subprocess.Popen[bytes]:
        try:
            return _start([sys.executable, "-m", "pipeline.launch", *argv],
                          env={**os.environ, INSIDE_ENV: mark}, pass_fds=(read,))
        finally:
            os.close(read)  # the child's copy is the mark

    try:
        return _serve(start)
    except OSError as exc:  # refused now though allowed a moment ago (a limit reached)
        return _refused(refusal(exc))
    except subprocess.SubprocessError as exc:
        return _refused(f"{type(exc).__name__}: {exc}")
