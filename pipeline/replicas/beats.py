"""A rank's beats into the job's record, and when it takes the job's coordinator for lost.

Each rank beats into the record (`beat/<pid>`) from a daemon thread, which a stall of the
process (SIGSTOP, a freeze) stops too; the launcher's watch (record.Liveness) ends a group
whose rank stopped beating. The same thread watches the coordinator for the rank: nothing
forms a quorum or keeps the record once it is gone, and a rank that waited in a quorum for
its timeout died of a bare connection error, naming nothing. A rank the launcher started
judges by its parent (the launcher, on this host); a rank of a group started by hand, by how
the coordinator fails to answer its beats (refused: gone; connections taken, nothing
answered: slow).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from pipeline import settings

__all__ = ["EXITING", "LAUNCHER_ENV", "LAUNCHER_LOST_EXIT", "LIVENESS_ENV", "beat_key",
           "start_beating"]

# Seconds a rank may go without a beat before the launcher ends its group; set by the launcher
# (unset: no beats, as under torchrun by hand).
LIVENESS_ENV = "PIPELINE_FT_LIVENESS"
# The launcher's pid, in its ranks' environment: named by a rank that finds it gone.
LAUNCHER_ENV = "PIPELINE_FT_LAUNCHER"
# Added to a rank's beat count as it exits: from then on it is not watched (its teardown may
# take longer than the timeout, with its beating thread already stopped by the interpreter).
EXITING = 1 << 40
LAUNCHER_LOST_EXIT = 75  # sysexits' EX_TEMPFAIL: the job may be started again from its save
_BEATS_PER_TIMEOUT = 10
_EXIT_JOIN_S = 10.0  # how long an exiting rank waits for a beat in flight
_LOST_FLOOR_S = 5.0  # replica_launch.RANK_TIMEOUT_FLOOR_S


@dataclass
class _Named:
    """This process's rank as its messages name it, and where its last committed state is
    (`last_state`, a callable, or None): a spare that takes a lost group's id is named anew,
    its beats going on, as "replica group g rank r (was spare group N)"."""

    group: str
    rank: int
    last_state: Any
    first: str  # the group it beat under first

    def who(self) -> str:
        was = "" if self.group == self.first else f" (was {self.first})"
        return f"{self.group} rank {self.rank}{was}"

    def state(self) -> str:
        with contextlib.suppress(Exception):
            return "unknown" if self.last_state is None else str(self.last_state())
        return "unknown"


# This process's rank, by its pid, once its beats started (a fork beats anew).
_beating: dict[int, _Named] = {}


def beat_key(pid: int) -> str:
    return f"beat/{pid}"


def start_beating(port: int, timeout: float, group: str, rank: int,
                  last_state: Any = None) -> None:
    """Beat into the record at `port` (`_start_beats`) from now on, once per process, where
    the launcher watches beats (LIVENESS_ENV set); a message names this rank `rank` of
    `group` ("replica group 1", "spare group 0"), and says where its last committed state is
    (`last_state()`). A later call names it anew: a spare's rank beats from its start, and
    is named as the group whose id it took once it took one (`_Named`)."""
    named = _beating.get(os.getpid())
    if named is not None:
        named.group, named.rank = group, rank
        named.last_state = last_state if last_state is not None else named.last_state
        return
    liveness = settings.number(LIVENESS_ENV, default=None, low=0.001, high=86400,
                               unit=" seconds")
    if liveness is not None:
        _beating[os.getpid()] = named = _Named(group, rank, last_state, group)
        _start_beats(port, liveness, timeout, named)


def _start_beats(port: int, liveness: float, timeout: float, named: _Named) -> None:
    """Beat every `liveness / 10` seconds from a daemon thread (a SIGSTOP stops it with the
    rest of the process), on a connection of its own: the rank's calls never wait behind a
    beat. At exit the thread is stopped first, then the rank says so on its own connection:
    its teardown is not watched. A launcher that is no longer this rank's parent, or, for a
    rank it did not start, a coordinator that answers no beat for `liveness` seconds, is gone
    (killed or crashed): nothing is left to form a quorum or keep the record, so the rank ends
    (LAUNCHER_LOST_EXIT) saying so, where it waited in a quorum until its timeout and died of
    a bare connection error. A coordinator that still takes the rank's connections but
    answers nothing is slow (`_shows`): the rank waits for it up to its own `timeout`."""
    from pipeline.replicas.record import connect  # looked up here: the record imports this

    key = beat_key(os.getpid())
    stop = threading.Event()
    period = liveness / _BEATS_PER_TIMEOUT
    # The coordinator is taken for gone after the liveness timeout, but never less than the
    # launcher's floor for a rank's (a slow answer on a loaded host is not a lost launcher).
    lost_after = max(liveness, _LOST_FLOOR_S)
    # A coordinator seen slow is waited for as long as any call of this rank waits for it:
    # ended sooner, a live rank of a live job would end; never, a stopped one holds it forever.
    slow_after = max(lost_after, timeout)

    answered = [time.monotonic()]  # when the coordinator last answered a beat (either side)
    held = [False]  # whether it took a connection and answered nothing since it last answered
    # Where the launcher started this rank, it is the rank's parent: gone once the parent is
    # another (this rank was handed to a reaper), alive, if slow, while it is the same. Its
    # silence alone ended live ranks on a loaded host where the launcher was held off the CPU.
    parent = _launcher_parent()

    def gone() -> str | None:
        now = os.getppid()
        return None if parent is None or now == parent else (
            f"exited (this rank's parent is now pid {now})")

    def beat() -> None:
        beats = None
        why = "no answer"
        # At exit beats stop, but not the watch while the coordinator is not answering: a
        # rank whose exit hangs (a quorum, a process group's teardown) still ends in time.
        while not (stop.is_set() and beats is not None):
            if (what := gone()) is not None:
                _launcher_lost(port, named, what)
            try:
                beats = connect(port, min(timeout, lost_after)) if beats is None else beats
                beats.add(key, 1)
                answered[0], held[0] = time.monotonic(), False
            except Exception as exc:
                beats, why = None, f"{type(exc).__name__}: {exc}"
                silent = time.monotonic() - answered[0]
                if (what := gone()) is not None:
                    _launcher_lost(port, named, f"{what}; {why}")
                shows = _shows(exc)
                held[0] = held[0] or shows == _SLOW
                slow = _slow(shows, held[0])
                if parent is None and silent >= (slow_after if slow else lost_after):
                    _launcher_lost(
                        port, named,
                        (f"takes this rank's connections but has answered nothing for "
                         f"{silent:.1f}s, this rank's timeout ({why})" if slow else
                         f"has answered no beat for {silent:.1f}s ({why})"),
                        _HELD if slow else _GONE_SAYS)
            stop.wait(period)

    thread = threading.Thread(target=beat, name="pipeline-ft-beat", daemon=True)

    def exiting() -> None:
        # Joined before the interpreter finalizes: a daemon thread still inside the store's
        # call then (which let go of the GIL) is ended by pthread_exit as it takes the GIL
        # back, through C++ frames that may not unwind: the rank aborts ("terminate called
        # without an active exception"), after its last commit.
        stop.set()
        thread.join(timeout=_EXIT_JOIN_S)
        if (what := gone()) is not None:  # nobody to tell: say so now, not after retries
            _launcher_lost(port, named, what)
        try:
            # Bounded as a beat is, not by the record's timeout: with the coordinator gone
            # (met first by the main thread) the record's client retried connecting for all
            # of it, 60 s, before this rank could say so.
            last = connect(port, min(timeout, lost_after))
            last.add(key, EXITING)
            last.close()
        except Exception as exc:  # a rank whose main thread met the lost coordinator first
            if parent is not None and gone() is None:
                return  # the launcher lives, held up: it sees this rank's exit all the same
            if parent is None and _slow(_shows(exc), held[0]):
                return  # the coordinator lives, held up: nothing of this rank is lost
            ago = time.monotonic() - answered[0]
            _launcher_lost(port, named, f"did not answer as this rank exited "
                                      f"({type(exc).__name__}: {exc}; it last answered a beat "
                                      f"{ago:.1f}s before)")

    atexit.register(exiting)
    thread.start()


# What a failed beat shows of the coordinator (`_shows`).
_GONE = "gone"  # refused or reset: its listening socket is closed, its process gone
_SLOW = "slow"  # its host took a fresh connection, its process answered nothing
_UNDECIDED = "undecided"  # a kept connection went silent: the next beat connects anew
_UNREACHABLE = "unreachable"  # no connection: its host gone, or its accept queue full
_GONE_SAYS = "it is gone, and with it the quorums and the job's record"
_HELD = ("it is stopped, or held off the CPU for longer than any call of this rank waits: "
         "the job cannot go on with it")


def _shows(exc: BaseException) -> str:
    """What a beat's failure `exc` shows of the coordinator, by the exception's type: a
    process that is killed has its sockets closed by the kernel (connections refused, a kept
    one reset or closed), one held off the CPU still has its kernel complete connections
    (its accept queue) but answers nothing, a host gone answers no connection."""
    from pipeline.replicas.wire import WireSilent

    if isinstance(exc, WireSilent):
        return _SLOW if exc.fresh else _UNDECIDED
    if isinstance(exc, ConnectionError):  # refused, reset, aborted, a broken pipe, closed
        return _GONE
    return _UNREACHABLE


def _slow(shows: str, held: bool) -> bool:
    """Whether a beat's failure that `shows` this leaves the coordinator slow, not gone
    (`held`: it was seen slow since it last answered). A full accept queue of a stopped
    coordinator drops connections as a host gone does: once it was seen slow, only a refusal
    says it is gone."""
    return shows in (_SLOW, _UNDECIDED) or (held and shows == _UNREACHABLE)


def _launcher_parent() -> int | None:
    """The launcher's pid where it is this process's parent (it started this rank on this
    host), else None (a group started by hand, or a launcher on another host)."""
    raw = os.environ.get(LAUNCHER_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) == os.getppid() else None


def _launcher_lost(port: int, named: _Named, what: str, says: str = _GONE_SAYS) -> None:
    """End this rank: the job's coordinator is gone, or held past this rank's timeout (`what`
    says how it was seen, `says` what that means). Says whose it was and where the last
    committed state is; exits at once (the main thread may be waiting in a quorum that nobody
    will form)."""
    host = "127.0.0.1"
    with contextlib.suppress(Exception):
        from pipeline.replicas.coordinator import lighthouse_hostport

        host = lighthouse_hostport()[0] if os.environ.get("TORCHFT_LIGHTHOUSE") else host
    pid = os.environ.get(LAUNCHER_ENV)
    owner = f"the launcher (pid {pid})" if pid else "`python -m pipeline.replica_launch --record`"
    print(f"pipeline: {named.who()}: the job's coordinator at {host}:{port}, kept by {owner}, "
          f"{what}: {says}; this rank exits ({LAUNCHER_LOST_EXIT}). {named.state()}",
          file=sys.stderr, flush=True)
    os._exit(LAUNCHER_LOST_EXIT)
