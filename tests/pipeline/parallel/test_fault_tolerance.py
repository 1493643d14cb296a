"""Pipeline replicas under torchft: bad input, a killed rank survived and healed, give-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe, PipeConfigError
from pipeline.launch import main as launch_main
from pipeline.parallel import fault_tolerance

needs_torchft = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchft") is None, reason="torchft not installed")
TRAIN = str(Path(__file__).parents[1] / "ft_train.py")
LAUNCH_TIMEOUT = 240  # seconds for a whole launch: a hang fails, never blocks the suite


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


# -- bad input --------------------------------------------------------------------------------
@needs_torchft
def test_without_environment_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (fault_tolerance.LIGHTHOUSE_ENV, fault_tolerance.REPLICA_ID_ENV,
                 fault_tolerance.NUM_REPLICAS_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PipeConfigError, match=r"TORCHFT_LIGHTHOUSE.*not set.*--replicas"):
        Pipe(_model(), balance=[1, 1], fault_tolerance=True)


@needs_torchft
def test_bad_replica_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fault_tolerance.LIGHTHOUSE_ENV, "http://127.0.0.1:1")
    monkeypatch.setenv(fault_tolerance.REPLICA_ID_ENV, "2")
    monkeypatch.setenv(fault_tolerance.NUM_REPLICAS_ENV, "2")
    with pytest.raises(PipeConfigError, match="REPLICA_GROUP_ID='2'"):
        Pipe(_model(), balance=[1, 1], fault_tolerance=True)


def test_without_torchft_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if it were not installed
    with pytest.raises(PipeConfigError, match=r"pip install 'pipeline-engine\[ft\]'"):
        Pipe(_model(), balance=[1, 1], fault_tolerance=True)


def test_launch_replicas_without_torchft(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(SystemExit) as exit_info:
        launch_main(["--replicas", "2", "--nproc", "2", TRAIN])
    assert exit_info.value.code == 2
    assert "--replicas needs torchft" in capsys.readouterr().err


def test_names_without_fault_tolerance() -> None:
    pipe = Pipe(_model(), balance=[1, 1])
    assert (pipe.replica_id, pipe.num_replicas) == (0, 1)
    with pytest.raises(PipeConfigError, match="fault_tolerance=True"):
        _ = pipe.committed_steps
    with pytest.raises(PipeConfigError, match="fault_tolerance=True"):
        pipe.fault_tolerant(torch.optim.SGD(pipe.parameters(), lr=0.1))


# -- replicas, a killed rank ------------------------------------------------------------------
def _launch(out: Path, *args: str, max_restarts: int = 3) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline.launch", "--replicas", "2", "--nproc", "2",
           "--max-restarts", str(max_restarts), TRAIN, str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          check=False)


def _log(out: Path, replica: int, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"log_{replica}_{rank}.jsonl").open()]


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("point", ["backward", "step"])
def test_killed_rank_survived_and_healed(tmp_path: Path, point: str) -> None:
    """Replica 1's rank 1 SIGKILLs itself at `point` of step 3 (step: after the pipeline's
    backward, before the cross-replica average): replica 0 keeps committing, replica 1 is
    restarted, heals from replica 0, and both end bit-identical at the same step."""
    done = _launch(tmp_path, "8", f"1:1:3:{point}")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "replica group 1 lost rank 1 (killed by SIGKILL)" in done.stderr
    finals = {(r, k): torch.load(tmp_path / f"final_{r}_{k}.pt") for r in (0, 1) for k in (0, 1)}
    for k in (0, 1):
        a, b = finals[0, k], finals[1, k]
        assert a["committed_steps"] == b["committed_steps"] >= 8
        assert a["model"].keys() == b["model"].keys()
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), (k, name)
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and sa
        for i in sa:
            for key in sa[i]:
                assert torch.equal(sa[i][key], sb[i][key]), (k, i, key)
    for k in (0, 1):  # the survivor: one step retried at most, then committed alone
        log = _log(tmp_path, 0, k)
        assert sum(not e["committed"] for e in log) <= 1, log
        assert any(e["committed"] and e["participants"] == 1 for e in log)
        assert log[-1]["participants"] == 2  # the last step had the healed replica back


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_more_failures_than_max_restarts(tmp_path: Path) -> None:
    done = _launch(tmp_path, "1000000", "1:0:2:forward", max_restarts=0)
    assert done.returncode == 1, done.stderr[-4000:]
    assert ("replica group 1 failed after 0 restart(s) (--max-restarts 0); failures: "
            "group 1: rank 0 killed by SIGKILL" in done.stderr), done.stderr[-4000:]
    assert "The other groups were stopped." in done.stderr


# -- a heal trusts no code from its peer ------------------------------------------------------
class _Payload:
    """A pickle that would run `touch <path>` when loaded without weights_only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (subprocess.call, (["touch", self.path],))


@needs_torchft
def test_a_heal_reads_its_peers_checkpoint_as_plain_data(tmp_path: Path) -> None:
    # torchft's own transport loads a peer's checkpoint with weights_only=False, and its
    # servers authenticate no one: whoever answers the healing rank could run code in it.
    import http.server
    import io
    import threading
    from datetime import timedelta

    from torch.distributed._serialization import _streaming_save

    planted = tmp_path / "ran"
    bodies = {"/good": {"step": 3, "w": torch.arange(4.0)}, "/evil": _Payload(str(planted))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            buffer = io.BytesIO()
            _streaming_save(bodies[self.path], buffer)  # the transport's format
            self.send_response(200)
            self.end_headers()
            self.wfile.write(buffer.getvalue())

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    transport = fault_tolerance._weights_only_transport(timedelta(seconds=10))
    try:
        good = transport._load_from_address(f"{base}/good", timedelta(seconds=10))
        assert good["step"] == 3 and torch.equal(good["w"], torch.arange(4.0))
        with pytest.raises(Exception, match=r"Weights only load failed|Unsupported global"):
            transport._load_from_address(f"{base}/evil", timedelta(seconds=10))
        assert not planted.exists()
    finally:
        transport.shutdown(wait=False)
        server.shutdown()
