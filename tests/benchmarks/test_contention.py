"""Contention (pipeline/planner/contention.py) in the benchmarks: a measurement that did not
get its CPUs is flagged, one that did is not; the records, report and environment.json carry
the figures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import load_summary, main, write_outputs
from benchmarks.config import Group
from benchmarks.records import build_records, validate_record
from benchmarks.report import render_markdown
from pipeline.planner import contention
from pipeline.planner.contention import MARK, Meter, Reading, Window
from tests.benchmarks import fakes


def _fake_machine(monkeypatch: pytest.MonkeyPatch, *, wall: list[float], cpu: list[float],
                  load: list[float], cores: int = 2, tree: list[float] | None = None,
                  stat: list[str | None] | None = None) -> None:
    """The clocks `Meter` reads, each returning the next of its values: `cpu` this process's
    CPU seconds, `tree` its and its children's (default: `cpu`), `stat` the text of
    /proc/stat (default: none, as where there is no /proc/stat)."""
    clocks: dict[str, Iterator[Any]] = {
        "wall": iter(wall), "cpu": iter(cpu), "tree": iter(cpu if tree is None else tree),
        "load": iter(load), "stat": iter([None, None] if stat is None else stat)}
    monkeypatch.setattr(contention, "wall_clock", lambda: next(clocks["wall"]))
    monkeypatch.setattr(contention, "cpu_seconds",
                        lambda *, children=False: next(clocks["tree" if children else "cpu"]))
    monkeypatch.setattr(contention, "load_average", lambda: next(clocks["load"]))
    monkeypatch.setattr(contention, "proc_stat", lambda: next(clocks["stat"]))
    monkeypatch.setattr(contention, "cores", lambda: cores)


def _stat(user: int, system: int, idle: int, steal: int = 0, *, nice: int = 0, iowait: int = 0,
          irq: int = 0, softirq: int = 0, guest: int = 0) -> str:
    """/proc/stat's text with these ticks (1/100 s) on its first line."""
    return (f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} {guest} 0\n"
            f"cpu0 {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} {guest} 0\n"
            f"intr 12345\n")


def test_the_machines_busy_time_is_all_but_idle_and_iowait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Guest time is inside user already; idle and iowait are not busy.
    text = _stat(100, 50, 1000, 40, nice=5, iowait=7, irq=3, softirq=2, guest=9)
    monkeypatch.setattr(contention, "proc_stat", lambda: text)
    monkeypatch.setattr(contention.os, "sysconf", lambda name: 100)
    assert contention.machine_busy() == pytest.approx(2.0)  # 100+5+50+3+2+40 ticks
    monkeypatch.setattr(contention, "proc_stat", lambda: None)
    assert contention.machine_busy() is None
    monkeypatch.setattr(contention, "proc_stat", lambda: "intr 1 2 3\n")
    assert contention.machine_busy() is None  # not the layout: the fallback rule judges


def _meter_between(monkeypatch: pytest.MonkeyPatch, before: str, after: str, *,
                   tree: tuple[float, float], cpu: tuple[float, float] = (5.0, 5.6),
                   load: tuple[float, float] = (1.0, 1.5)) -> Reading:
    monkeypatch.setattr(contention.os, "sysconf", lambda name: 100)
    _fake_machine(monkeypatch, wall=[10.0, 12.0], cpu=list(cpu), tree=list(tree),
                  load=list(load), stat=[before, after])
    with Meter(2) as meter:
        pass
    assert meter.reading is not None
    return meter.reading


def test_other_programs_cpu_time_flags_a_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    # In 2 s the machine was busy 2.0 s more (200 ticks); this process and its children used
    # 1.2 s of it: others took 0.8 s, 0.4 of a CPU on average, over the 0.25 limit.
    reading = _meter_between(monkeypatch, _stat(1000, 500, 9000), _stat(1150, 550, 9200),
                             tree=(3.0, 4.2))
    assert reading.others_cpu_s == pytest.approx(0.8)
    assert reading.others_wall_s == pytest.approx(2.0)
    assert reading.others_cores == pytest.approx(0.4)
    assert reading.reasons() == [
        "other programs took 0.40 CPUs on average (0.8 s of CPU in 2.0 s; over 0.25 is "
        "contended)"]
    facts = reading.to_dict()
    assert facts["contended"] is True and facts["rule"] == "others"
    assert facts["others_cpu_s"] == pytest.approx(0.8) and facts["others_limit"] == 0.25


def test_a_waiting_pipeline_alone_is_not_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two threads that wait for each other's messages: 0.6 s of CPU in 2 s (15% of what they
    # could use) under a load average above the cores counts its own threads. The old rule
    # flagged it; the machine was busy 0.7 s, 0.6 s of it ours: others took 0.05 of a CPU.
    reading = _meter_between(monkeypatch, _stat(1000, 500, 9000), _stat(1060, 510, 9330),
                             tree=(3.0, 3.6), cpu=(5.0, 5.6), load=(2.5, 3.0))
    assert reading.cpu_share == pytest.approx(0.15)
    assert reading.others_cores == pytest.approx(0.05)
    assert reading.reasons() == [] and reading.to_dict()["contended"] is False
    assert Reading(2.0, 0.6, 2, 2, 2.5, 3.0).contended()  # the fallback rule would flag it


def test_steal_time_is_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    # A virtual machine's neighbours: 1.0 s stolen in 2 s, nothing else busy but ours.
    reading = _meter_between(monkeypatch, _stat(1000, 500, 9000, steal=10),
                             _stat(1040, 510, 9290, steal=110), tree=(3.0, 3.5))
    assert reading.others_cpu_s == pytest.approx(1.0) and reading.contended()


def test_windows_of_a_groups_processes_merge() -> None:
    # Three processes over one window: each read the same machine, each its own CPU time.
    merged = Window.merged([Window(4.0, 1.5, 6.0), Window(4.01, 2.0, 6.0),
                            Window(3.99, 0.5, 6.02)])
    assert merged == Window(4.0, 4.0, 6.0) and merged.others_s == pytest.approx(2.0)
    assert Window(1.0, 0.5, None).others_s is None
    assert Reading(1.0, 0.5, 2, 2).with_window(Window(2.0, 1.0, 1.2)).others_cores == \
        pytest.approx(0.1)


def test_a_step_that_got_its_cpus_is_not_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 threads, 1 s of wall time, 1.9 s of CPU: they ran; the load stayed below 2 cores.
    _fake_machine(monkeypatch, wall=[10.0, 11.0], cpu=[5.0, 6.9], load=[1.2, 1.8])
    with Meter(2) as meter:
        pass
    reading = meter.reading
    assert reading == Reading(1.0, pytest.approx(1.9), 2, 2, 1.2, 1.8)
    assert reading.cpu_share == pytest.approx(0.95)
    assert not reading.contended() and reading.reasons() == []
    assert reading.to_dict()["contended"] is False


def test_a_step_that_waited_for_its_cpus_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 threads, 1 s of wall time, 0.6 s of CPU: most of the time they waited.
    _fake_machine(monkeypatch, wall=[10.0, 11.0], cpu=[5.0, 5.6], load=[1.0, 1.5])
    with Meter(2) as meter:
        pass
    assert meter.reading is not None
    assert meter.reading.cpu_share == pytest.approx(0.3)
    assert meter.reading.reasons() == [
        "it got 30.0% of the CPU time its 2 threads could use (under 50%)"]
    facts = meter.reading.to_dict()
    assert facts["contended"] is True and facts["cpu_s"] == pytest.approx(0.6)


def test_a_load_above_the_cores_flags_even_a_busy_step(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, wall=[0.0, 1.0], cpu=[0.0, 1.0], load=[1.0, 11.5])
    with Meter(1) as meter:
        pass
    assert meter.reading is not None
    assert meter.reading.reasons() == ["the load average was 11.5 on 2 cores"]


def test_a_pipeline_is_judged_outside_its_bubble() -> None:
    # Two ranks busy two thirds of the step (1f1b, p=2, m=2) with 1.2 s of CPU in 1 s.
    reading = Reading(1.0, 1.2, 2, 16, busy=2 / 3)
    assert reading.cpu_share == pytest.approx(0.9) and not reading.contended()
    assert Reading(1.0, 1.2, 2, 16).cpu_share == pytest.approx(0.6)


def test_rounds_add_up_and_keep_the_highest_load() -> None:
    total = Reading.total([Reading(1.0, 0.5, 2, 2, 0.5, 0.7), Reading(2.0, 2.0, 2, 2, 3.0, 1.0)])
    assert total == Reading(3.0, 2.5, 2, 2, 3.0, 1.0)
    assert Reading.total([]) is None


def _records(g: Group, **measured: Any) -> list[dict[str, Any]]:
    return [r for r, _ in build_records(g, {4: fakes.measured(g, 4, **measured)}, fakes.ENV)]


def test_records_and_the_report_mark_contended_figures() -> None:
    g = fakes.group(2, schedules=("1f1b",), transports=("processes",))
    calm = _records(g, cpu_share=1.0, load=(0.3, 0.4))
    busy = _records(g, cpu_share=0.2, load=(0.3, 0.4))
    for r in calm + busy:
        validate_record(r)
    cells = calm[0]["contention"]
    assert set(cells) == {"ours", "torch", "plain_1_thread", "plain_all_threads",
                          "hardware_bound"}
    assert all(c["contended"] is False for c in cells.values())
    assert cells["plain_all_threads"]["threads"] == 2 and cells["ours"]["busy"] < 1
    assert all(c["contended"] is True for c in busy[0]["contention"].values())
    calm_report = render_markdown(calm, fakes.ENV, suite="quick", command="cmd")
    busy_report = render_markdown(busy, fakes.ENV, suite="quick", command="cmd")
    assert "measured under contention" not in calm_report
    assert busy_report.count("measured under contention") >= 2  # results and baselines
    row = next(line for line in busy_report.splitlines() if line.startswith("| processes"))
    assert f" {MARK} |" in row  # beside the step time
    step_ms = row.split("|")[5]
    assert step_ms.strip().endswith(MARK)
    target = next(line for line in busy_report.splitlines()
                  if line.startswith("| ours / torch, 1f1b, p=2, m=4"))
    assert MARK in target
    # Only the load: figures from processes that had their CPUs on a loaded machine.
    loaded = _records(g, cpu_share=1.0, load=(5.0, 6.0))
    assert loaded[0]["contention"]["ours"]["reasons"] == [
        "the load average was 6.0 on 2 cores"]


def test_records_judge_by_what_other_programs_took() -> None:
    """Every p=2 cell of an idle quick run was flagged: a small pipeline waits for messages,
    and its CPU share is low with nobody else running. Where the machine's busy time is known,
    what other programs took over the rounds' window judges instead."""
    g = fakes.group(2, schedules=("1f1b",), transports=("processes",))
    # 20 s of rounds; the group's processes used 15 s of the machine's 15.5 s busy.
    calm = _records(g, cpu_share=0.2, load=(2.5, 3.0), window=Window(20.0, 15.0, 15.5))
    cells = calm[0]["contention"]
    assert all(c["contended"] is False and c["rule"] == "others" for c in cells.values())
    assert cells["ours"]["others_cpu_s"] == pytest.approx(0.5)
    assert cells["ours"]["cpu_share"] < contention.CPU_SHARE_FLOOR  # the old rule's flag
    # Two busy programs on the same 2 cores: the machine was busy 39 s, ours 15 s.
    busy = _records(g, cpu_share=1.0, load=(0.5, 0.5), window=Window(20.0, 15.0, 39.0))
    assert all(c["contended"] is True for c in busy[0]["contention"].values())
    assert busy[0]["contention"]["ours"]["reasons"] == [
        "other programs took 1.20 CPUs on average (24.0 s of CPU in 20.0 s; over 0.25 is "
        "contended)"]
    report = render_markdown(busy, fakes.ENV, suite="quick", command="cmd")
    assert "other programs took more than 0.25 CPUs on average" in report  # the footnote


def test_environment_json_carries_the_load(tmp_path: Path) -> None:
    g = fakes.group(2, schedules=("1f1b",), transports=("processes",))
    records = _records(g, cpu_share=0.2)
    env = {**fakes.ENV, "load": load_summary(Reading(30.0, 12.0, 2, 2, 3.5, 4.0), records)}
    write_outputs(tmp_path, records, {}, env, suite="quick", command="cmd", plots=False)
    load = json.loads((tmp_path / "environment.json").read_text())["load"]
    assert load["load_before"] == 3.5 and load["load_after"] == 4.0
    assert load["cpu_s"] == 12.0 and load["wall_s"] == 30.0
    assert load["cpu_share_floor"] == contention.CPU_SHARE_FLOOR
    assert load["contended_cells"] == [r["id"] for r in records]
    assert load["others_cpu_s"] is None  # this run had no window
    report = (tmp_path / "report.md").read_text()
    assert "load average 3.5 before the run, 4.0 after" in report
    assert "other programs' CPU time unknown (no /proc/stat" in report
    run = Reading(30.0, 12.0, 2, 2, 3.5, 4.0).with_window(Window(30.0, 12.0, 13.5))
    write_outputs(tmp_path, records, {}, {**fakes.ENV, "load": load_summary(run, records)},
                  suite="quick", command="cmd", plots=False)
    assert json.loads((tmp_path / "environment.json").read_text())["load"]["others_cpu_s"] \
        == pytest.approx(1.5)
    assert "other programs took 1.5 s of CPU meanwhile" in (tmp_path / "report.md").read_text()
    assert f"1 configuration(s) measured under contention**, their figures marked {MARK}" \
        in report


def test_the_progress_bar_prints_its_last_line_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar reached 100 % on the last unit's update and close() drew it again: in a log
    (no terminal), two '100%' lines."""
    def fake_spawn(fn: object, n: int, group: Group, gate: object, progress: Any,
                   timeout: float) -> list[dict[int, Any]]:
        for m in group.microbatches:
            time.sleep(0.15)  # past tqdm's interval between draws: each update draws
            progress.put(m)
        time.sleep(0.15)
        return [{m: fakes.measured(group, m, cpu_share=1.0) for m in group.microbatches}]

    monkeypatch.setattr("benchmarks.cli.spawn", fake_spawn)
    monkeypatch.setattr(contention, "load_average", lambda: 0.5)
    out = tmp_path / "bench"
    assert main(["--models", "tiny", "--ranks", "2", "--microbatches", "2,4", "--schedules",
                 "1f1b", "--transport", "processes", "--no-plots", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    drawn = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert sum("100%" in line for line in drawn) == 1, drawn
    assert drawn[-1].startswith("100%") and "2/2" in drawn[-1]
    env = json.loads((out / "environment.json").read_text())
    assert env["load"]["load_before"] == 0.5 and env["load"]["contended_cells"] == []
    assert env["load"]["cpu_s"] is not None and env["load"]["wall_s"] > 0.3


_PROC_STAT = pytest.mark.skipif(contention.machine_busy() is None,
                                reason="no /proc/stat here (not Linux): the fallback rule judges")


def _others_alone(seconds: float = 1.0) -> float:
    """The CPUs other programs take on average while this process sleeps."""
    with Meter(1) as meter:
        time.sleep(seconds)
    assert meter.reading is not None and meter.reading.others_cores is not None
    return meter.reading.others_cores


def _skip_if_the_machine_is_busy(when: str) -> None:
    others = _others_alone()
    if others > contention.OTHERS_LIMIT / 2:
        pytest.skip(f"other programs took {others:.2f} CPUs on average {when} (over half the "
                    f"{contention.OTHERS_LIMIT} limit): this machine is not quiet enough to "
                    f"show that a measurement alone is not flagged")


@_PROC_STAT
def test_a_measurement_beside_busy_processes_is_flagged(busy: None) -> None:
    # One spinning process per core (tests/busy.py): they take every CPU this one sleeps on.
    with Meter(1) as meter:
        time.sleep(1.0)
    assert meter.reading is not None and meter.reading.contended(), meter.reading
    assert meter.reading.others_cores is not None
    assert meter.reading.others_cores > 0.5 * contention.cores()
    assert meter.reading.reasons()[0].startswith("other programs took")


def _ping_pong(seconds: float) -> int:
    """Two threads that wait for each other's messages, as a two-rank pipeline does: each
    computes a little, sends to the other, and waits for the answer (a wire's latency)."""
    import queue
    import threading

    boxes: list[queue.Queue[int]] = [queue.Queue(), queue.Queue()]
    end = time.perf_counter() + seconds
    hops = [0]

    def rank(me: int) -> None:
        while True:
            if me == 1 or hops[0]:
                value = boxes[me].get()
                if value < 0:
                    return
            spin = time.perf_counter() + 0.001
            while time.perf_counter() < spin:  # a millisecond of compute
                pass
            time.sleep(0.002)  # the message on its way
            hops[0] += 1
            boxes[1 - me].put(-1 if time.perf_counter() > end else hops[0])
            if time.perf_counter() > end:
                return

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return hops[0]


# `alone`: on the suite's workers, the tests beside it would take the CPUs and it would skip
# (tests/workers.py); with none beside it, it shows what it says on a quiet machine.
@pytest.mark.alone
@_PROC_STAT
def test_a_waiting_pipeline_alone_on_a_quiet_machine_is_not_flagged() -> None:
    """Every p=2 cell of an idle quick run was flagged by the CPU share: a pipeline that waits
    for messages does not use the CPUs it could. What other programs took does not move."""
    flagged = []
    for _ in range(3):  # another program's burst can land in one try: the rule flags it rightly
        _skip_if_the_machine_is_busy("before the test")
        with Meter(2) as meter:
            hops = _ping_pong(1.5)
        _skip_if_the_machine_is_busy("after the test")  # noise that came meanwhile
        reading = meter.reading
        assert reading is not None and hops > 100
        share = reading.cpu_share
        assert share is not None and share < contention.CPU_SHARE_FLOOR  # the old rule's flag
        if not reading.contended():
            return
        flagged.append(reading.to_dict())
    pytest.fail(f"a waiting pipeline alone was flagged in 3 tries out of 3: {flagged}")


@pytest.mark.alone  # a quiet machine, as above
@_PROC_STAT
def test_children_of_a_measurement_count_as_its_own() -> None:
    """A process-backed pipeline's ranks are child processes: their CPU time is the run's,
    not other programs'."""
    import subprocess
    import sys

    _skip_if_the_machine_is_busy("before the test")
    spin = "import time\nend = time.perf_counter() + 1.5\nwhile time.perf_counter() < end: pass"
    with Meter(1, children=True) as meter:
        subprocess.run([sys.executable, "-c", spin], check=True)
    _skip_if_the_machine_is_busy("after the test")
    reading = meter.reading
    assert reading is not None and reading.cpu_s > 1.0  # the child's spin, counted as ours
    assert not reading.contended(), reading.to_dict()
