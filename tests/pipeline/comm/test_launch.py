"""pipeline.launch: torchrun's environment per rank, `spawn` for tests, the CLI's failure rule."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.launch import ALLOCATOR, RankFailed, free_port, main, rank_env, spawn
from tests.limits import SPAWN_TIMEOUT


def _whoami(rank: int, tag: str) -> tuple[Any, ...]:
    import torch.distributed as dist

    return (rank, dist.get_rank(), dist.get_world_size(), os.environ["RANK"], tag)


def _fail_on_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    return rank * 10


def test_rank_env_is_torchruns_with_gloo_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for key in ALLOCATOR:
        monkeypatch.delenv(key, raising=False)
    env = rank_env(2, 4, 29500)
    assert env == {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                   "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                   # ranks join the store the launcher hosts on loopback, never host one
                   "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                   "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_env(0, 1, 1)["OMP_NUM_THREADS"] == "3"  # the user's choice is kept
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the user tunes the allocator
    assert not set(ALLOCATOR) & set(rank_env(0, 1, 1))


def _allocator_seen(rank: int) -> dict[str, str | None]:
    # The environment the process started with (glibc reads its variables then), not the one
    # the rank set up afterwards.
    with open("/proc/self/environ", "rb") as f:
        start = dict(e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e)
    return {key: start.get(key) for key in ALLOCATOR}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux's /proc")
def test_spawned_ranks_start_with_the_allocator_settings_and_the_caller_keeps_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ALLOCATOR:
        monkeypatch.delenv(key, raising=False)
    assert spawn(_allocator_seen, 1) == [ALLOCATOR]
    assert not set(ALLOCATOR) & set(os.environ)  # set around the start only


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.dist
def test_spawn_returns_each_ranks_result_in_rank_order() -> None:
    assert spawn(_whoami, 2, "x", timeout=SPAWN_TIMEOUT) == [(0, 0, 2, "0", "x"),
                                                             (1, 1, 2, "1", "x")]


@pytest.mark.dist
def test_spawn_names_the_failed_rank_and_keeps_the_others_results() -> None:
    with pytest.raises(RankFailed, match=r"rank 1: ValueError: rank one says no") as err:
        spawn(_fail_on_one, 2, timeout=SPAWN_TIMEOUT)
    assert err.value.results == {0: 0}


def _same(q: Any) -> Any:
    return q


class _LateQueue:
    """spawn's result queue as a loaded machine can make it look to the parent: the first wait
    gives up (empty) only after every rank has reported and exited."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held = True

    def __reduce__(self) -> tuple[Any, ...]:
        return _same, (self.inner,)  # the ranks put into the real queue

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.held and block:
            self.held = False
            deadline = time.monotonic() + 90
            while mp.active_children() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise queue.Empty
        return self.inner.get(block, timeout)


@pytest.mark.dist
def test_spawn_reads_reports_that_arrive_as_their_ranks_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a rank that reported and exited between the parent's get giving up and its
    # look at the exit codes was called dead ("process died (exit code 0)").
    get_context = mp.get_context

    class Context:
        def __init__(self, method: str) -> None:
            self.ctx = get_context(method)

        def Queue(self) -> _LateQueue:  # (multiprocessing's name)
            return _LateQueue(self.ctx.Queue())

        def Process(self, *args: Any, **kwargs: Any) -> Any:
            return self.ctx.Process(*args, **kwargs)

    monkeypatch.setattr(mp, "get_context", Context)
    assert spawn(_whoami, 2, "x", timeout=SPAWN_TIMEOUT) == [(0, 0, 2, "0", "x"),
                                                             (1, 1, 2, "1", "x")]


_EARLY: list[bool] = []  # on rank 1 of the test below: rank 0 ran `fn` before rank 1 joined


def _joins_late(fn: Any, rank: int, *rest: Any) -> None:
    """spawn's child, with rank 1's init_process_group lingering after it returns: up to 3 s,
    until rank 0 says it has started `fn`."""
    import torch.distributed as dist

    from pipeline import launch

    init = dist.init_process_group

    def lingering(*args: Any, **kwargs: Any) -> None:
        init(*args, **kwargs)
        if rank == 1:
            store = dist.distributed_c10d._get_default_store()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not store.check(["test/fn started"]):
                time.sleep(0.01)
            _EARLY.append(store.check(["test/fn started"]))

    dist.init_process_group = lingering  # type: ignore[assignment]
    launch._child(fn, rank, *rest)


def _started_before_all_joined(rank: int) -> bool:
    import torch.distributed as dist

    if rank == 0:
        dist.distributed_c10d._get_default_store().set("test/fn started", "1")
        return False
    return _EARLY[0]


@pytest.mark.dist
def test_spawn_runs_fn_only_once_every_rank_has_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a rank ran `fn` as soon as its own init_process_group returned; one whose `fn`
    # returned at once exited and broke the pairs a slower rank was still connecting (under
    # load: "Gloo connectFullMesh failed ... Connection closed by peer" on rank 1).
    get_context = mp.get_context

    class Context:
        def __init__(self, method: str) -> None:
            self.ctx = get_context(method)

        def Queue(self) -> Any:
            return self.ctx.Queue()

        def Process(self, *, target: Any, **kwargs: Any) -> Any:
            return self.ctx.Process(target=_joins_late, **kwargs)

    monkeypatch.setattr(mp, "get_context", Context)
    assert spawn(_started_before_all_joined, 2, timeout=SPAWN_TIMEOUT) == [False, False]


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text("import json, os, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return path


@pytest.mark.timeout(60)
def test_main_starts_every_rank_with_its_environment(tmp_path: Path) -> None:
    script = _script(tmp_path, "json.dump(dict(os.environ), open(sys.argv[1] + str(rank), 'w'))\n")
    assert main(["--nproc", "2", str(script), str(tmp_path / "env")]) == 0
    envs = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


@pytest.mark.timeout(60)
def test_main_stops_the_others_after_the_grace_and_returns_the_failure_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, "sys.exit(3) if rank == 1 else time.sleep(600)\n")
    start = time.monotonic()
    assert main(["--nproc", "2", "--grace", "0.5", str(script)]) == 3
    assert time.monotonic() - start < 30  # rank 0 was killed, not waited for
    assert "rank 1 exited with code 3" in capsys.readouterr().err


def test_main_refuses_zero_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--nproc", "0", sys.executable])
    assert exc.value.code == 2 and "--nproc must be >= 1 (got 0)" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_python_dash_m_launch_runs_the_script_without_a_runpy_warning(tmp_path: Path) -> None:
    """Importing `pipeline` once imported `pipeline.launch` (for INIT_TIMEOUT_ENV), so runpy
    warned "'pipeline.launch' found in sys.modules after import of package 'pipeline'" before
    the script ran; under -W error the warning was an exception and the launch failed."""
    script = _script(tmp_path, "print('ran', rank)\n")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-W", "error", "-m", "pipeline.launch", "--nproc",
                             "1", str(script)], capture_output=True, text=True, env=env,
                            cwd=root, timeout=100, check=False)
    assert "RuntimeWarning" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran 0"


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_is_passed_on_to_every_rank_and_waited_for(
        tmp_path: Path) -> None:
    """`python -m pipeline.launch --nproc 2` sent SIGTERM (a scheduler's stop) sends it on to
    each rank, waits for them, and exits 128 + 15; it used to exit at once and leave its ranks
    running."""
    import signal

    from tests.pipeline.ft_give_up import stop_launch

    code, err, stopped = stop_launch(["--nproc", "2"], str(tmp_path), 2)
    assert code == 128 + signal.SIGTERM, err[-4000:]
    assert "stopped by SIGTERM" in err
    assert stopped == ["stopped_0_0", "stopped_0_1"]
