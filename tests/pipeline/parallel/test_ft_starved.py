"""The launcher's watch tells a starved rank from a stalled one (pipeline/replicas/run_queue.py,
`Liveness` in pipeline/replicas/record.py): the time a silent rank's threads waited on a run
queue is taken off its silence, up to a bound; a rank that waited on none is stalled at the
timeout. Over a /proc laid out in a directory, and a clock the test moves."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.replicas.beats import beat_key
from pipeline.replicas.coordinator import KeyStore
from pipeline.replicas.record import STARVED_LIMIT_S, Liveness, Stall
from pipeline.replicas.run_queue import RunQueue, Window

PID, BEAT_TID = 4242, 4250  # a rank: its main thread (tid = pid) and its beating thread
TIMEOUT = 1.0
LOOK = 0.25  # as often as the launcher looks, below half the timeout (no fresh window)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rank:
    """One rank's beats in the record and its threads' run-queue waits under a fake /proc."""

    def __init__(self, proc: Path, store: KeyStore, pid: int = PID) -> None:
        self.proc, self.store, self.pid = proc, store, pid
        self.waits = {pid: 0, BEAT_TID: 0}
        self.runnable: set[int] = set()  # threads on a run queue that have not run since
        self.write()
        store.add(beat_key(pid), 1)

    def write(self) -> None:
        for tid, ns in self.waits.items():
            path = self.proc / str(self.pid) / "task" / str(tid)
            path.mkdir(parents=True, exist_ok=True)
            (path / "schedstat").write_text(f"123456 {ns} 78\n")
            state = "R" if tid in self.runnable else "S"
            (path / "stat").write_text(f"{tid} (python) worker) {state} 1 2 3\n")

    def wait(self, tid: int, seconds: float) -> None:
        self.waits[tid] = self.waits.get(tid, 0) + round(seconds * 1e9)
        self.write()


def _watch(proc: Path, store: KeyStore, notes: list[str] | None = None,
           ) -> tuple[Liveness, Clock]:
    clock = Clock()
    sink = notes if notes is not None else []
    return Liveness(store, TIMEOUT, proc=proc, note=sink.append, clock=clock), clock


def _silent_for(watch: Liveness, clock: Clock, rank: Rank | None, seconds: float,
                waiting: dict[int, float] | None = None) -> Stall | None:
    """Look every LOOK seconds for `seconds` while the rank beats no more, its threads
    waiting `waiting[tid]` of each second on a run queue; the first stall seen."""
    for _ in range(round(seconds / LOOK)):
        clock.now += LOOK
        for tid, share in (waiting or {}).items():
            assert rank is not None
            rank.wait(tid, share * LOOK)
        stall = watch.stalled([PID])
        if stall is not None:
            return stall
    return None


def test_a_silent_rank_that_waited_on_no_run_queue_is_stalled_at_the_timeout(
        tmp_path: Path) -> None:
    """A SIGSTOPped rank: no thread is runnable, its waits do not move."""
    store = KeyStore()
    rank = Rank(tmp_path, store)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    stall = _silent_for(watch, clock, rank, 3.0)
    assert stall is not None and stall.pid == PID and stall.starved == 0.0
    assert TIMEOUT < stall.silent <= TIMEOUT + LOOK  # seen at the first look past the timeout


@pytest.mark.parametrize("tid", [PID, BEAT_TID], ids=["main thread", "beating thread"])
def test_a_silent_rank_that_waited_for_a_cpu_is_not_stalled(tmp_path: Path, tid: int) -> None:
    """Held off the CPU (90% of the time on a run queue, as beside 8 busy processes a core):
    either thread's wait counts, the main thread's because the beating thread waits for the
    GIL it holds. Once it is stopped for real (its waits stop), the timeout runs from there."""
    store = KeyStore()
    rank = Rank(tmp_path, store)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    assert _silent_for(watch, clock, rank, 6 * TIMEOUT, {tid: 0.9}) is None  # silent 6 s
    stall = _silent_for(watch, clock, rank, 3 * TIMEOUT)
    assert stall is not None and stall.pid == PID
    # Read from a quarter of the timeout on: the first look's wait is not taken off.
    assert stall.starved == pytest.approx(0.9 * (6 * TIMEOUT - LOOK))
    assert TIMEOUT < stall.silent - stall.starved <= TIMEOUT + LOOK


def test_a_beat_starts_a_fresh_window_of_waits(tmp_path: Path) -> None:
    """Waits before the last beat are not taken off the silence after it."""
    store = KeyStore()
    rank = Rank(tmp_path, store)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    assert _silent_for(watch, clock, rank, 4 * TIMEOUT, {PID: 0.9}) is None
    store.add(beat_key(PID), 1)  # it ran, beat, and then stopped for real
    stall = _silent_for(watch, clock, rank, 3 * TIMEOUT)
    assert stall is not None and stall.starved == 0.0


def test_the_discount_is_bounded(tmp_path: Path) -> None:
    """A rank that runs nothing for minutes is ended at the timeout plus STARVED_LIMIT_S,
    whatever it waited."""
    store = KeyStore()
    rank = Rank(tmp_path, store)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    stall = _silent_for(watch, clock, rank, 2 * STARVED_LIMIT_S, {PID: 1.0})
    assert stall is not None and stall.starved == STARVED_LIMIT_S
    assert stall.silent == pytest.approx(TIMEOUT + STARVED_LIMIT_S + LOOK)


def test_a_rank_of_another_host_keeps_the_plain_timeout(tmp_path: Path) -> None:
    """No entry under /proc (a rank not started on this host): nothing is taken off."""
    store = KeyStore()
    store.add(beat_key(PID), 1)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    stall = _silent_for(watch, clock, None, 3.0)
    assert stall is not None and stall.starved == 0.0 and stall.silent <= TIMEOUT + LOOK


def test_a_kernel_without_run_queue_waits_is_noted_once_and_keeps_the_plain_timeout(
        tmp_path: Path) -> None:
    """Threads listed without schedstat (no CONFIG_SCHED_INFO): one note, naming the file,
    the rule that then applies and the way out; the plain timeout judges."""
    store = KeyStore()
    for pid in (PID, PID + 1):
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)
        store.add(beat_key(pid), 1)
    notes: list[str] = []
    watch, clock = _watch(tmp_path, store, notes)
    assert watch.stalled([PID, PID + 1]) is None
    stall = _silent_for(watch, clock, None, 3.0)
    assert stall is not None and stall.starved == 0.0
    assert len(notes) == 1, notes
    assert "schedstat" in notes[0] and "CONFIG_SCHED_INFO" in notes[0]
    assert "--heartbeat-timeout" in notes[0]


def test_a_thread_born_in_the_window_counts_its_whole_wait(tmp_path: Path) -> None:
    run_queue = RunQueue(tmp_path, note=pytest.fail)
    rank = Rank(tmp_path, KeyStore())
    window = Window(run_queue.waits(PID), 0.0)
    rank.wait(PID + 9, 2.0)  # a thread started since, which waited 2 s
    rank.wait(PID, 0.5)
    assert window.waited(run_queue.waits(PID), 1.0) == pytest.approx(2.0)
    assert Window(None, 0.0).waited(run_queue.waits(PID), 1.0) == 0.0


def test_a_wait_the_kernel_has_not_added_yet_counts(tmp_path: Path) -> None:
    """The kernel adds a thread's wait to schedstat only once it runs again: a thread seen
    runnable with the same counters from one look to the next has waited since the first,
    and that wait ends (into schedstat) once it ran."""
    store = KeyStore()
    rank = Rank(tmp_path, store)
    watch, clock = _watch(tmp_path, store)
    assert watch.stalled([PID]) is None
    rank.runnable.add(PID)  # on a run queue from here on, not run since
    rank.write()
    assert _silent_for(watch, clock, rank, 5 * TIMEOUT) is None
    rank.runnable.clear()
    rank.wait(PID, 4.0)  # it ran: the kernel adds what it waited; then it stops for real
    stall = _silent_for(watch, clock, rank, 3 * TIMEOUT)
    assert stall is not None and stall.starved == pytest.approx(4.0)


def test_this_process_s_own_threads_are_read(tmp_path: Path) -> None:
    """On the real /proc: this process's main thread and another of its threads, and whether
    each is runnable."""
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no run-queue waits (no /proc/<pid>/task/<tid>/schedstat)")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # until the other thread has gone to sleep on its event
            waits = RunQueue(note=pytest.fail).waits(os.getpid())
            assert waits is not None and os.getpid() in waits and other.native_id in waits
            if not waits[other.native_id].runnable or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        stop.set()
        other.join()
    assert all(t.ran >= 0 and t.waited >= 0 for t in waits.values())
    # This thread runs as it reads (R), the other sleeps on its event (S).
    assert waits[os.getpid()].runnable and not waits[other.native_id].runnable
