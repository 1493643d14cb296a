"""A fault-tolerant training script: run by tests/pipeline/parallel/test_fault_tolerance.py
under `python -m pipeline.launch --replicas R --nproc 2`, and by the docs' measurement.

    python tests/pipeline/ft_train.py OUT STEPS [--kill SPEC[,SPEC...]] [--checkpoint-every N]
                                      [--scaler] [--layout L] [--min-step-ms MS]
                                      [--deadline S] [--until PATH] [--kill-after PATH]
                                      [--exact] [--restart-delay S] [--start-together]

SPEC is "replica:rank:step:point": that rank SIGKILLs itself at `point` of the first step it
runs at or after committed step `step`. Points: forward, backward (inside the pipeline's),
step (after the backward, before the cross-replica average), allreduce (inside the average's
collective, once the same rank of another replica is inside it too), optimizer (inside the
optimizer's step, after the quorum agreed to commit), heal (a group restarted after the
previous kill, while it fetches its state from its peer), source (a rank of a group the previous
kill's group heals from: as it is about to serve that heal, once the healing group's other ranks
have healed, so that the healing group is left half healed), end (after the loop, before the final
state is saved: lost after the job's last commit), stall (at `step`, SIGSTOP instead: the rank
stays, frozen, until the launcher sees it stopped beating and ends its group). Kills run in
the order given, each once per job (OUT/killed_<i> marks it done, with the time and step),
and each only after every replica took part in a step after the previous kill (the first,
after every replica took part in a step): one group is lost at a time.

--scaler: train through a GradScaler (its scale grows every GROWTH_INTERVAL steps, so a heal
must carry it), and replica 1's batch of step INF_STEP holds an inf: every replica must skip
that step alike.

--layout tp|replicate|fsdp: each replica group is one stage of tests/models_tp.py's MLP over
two ranks of the group: tensor-parallel (its plan), or data-parallel (replicated, or sharded by
FSDP2); the final state saved whole.

--scheduler: a LambdaLR scheduler (lr x 0.9 per step) stepped after each committed step and
carried by a heal (`pipe.fault_tolerant(..., state={"scheduler": ...})`); its state is saved.

--deadline S: pipe.training_steps(..., deadline=S) (the library's 300 s by default): how long
a group that reached STEPS waits for a lost group to come back (none does in a job started by
hand, where no launcher restarts it).

--kill-after PATH: no kill is armed before PATH exists (a test's word: a spare it waited for is
ready); the job goes on meanwhile, as it does until every kill ran.

--until PATH: after STEPS, go on one step at a time until PATH exists (a test's word: a spare
it waited for is ready); the first replica to see it fixes the step all end at, a few steps
on (OUT/stop_at), so that every replica reads it before it gets there.

--exact: the loop is `pipe.training_steps(STEPS)` alone: no step past STEPS, whether or not
every kill ran (without it, a job with kills or --until goes on past STEPS until every kill
ran and a step held every replica).

--restart-delay S: a group's rank started again (it logged a start before) sleeps S seconds
before it builds its Pipe: a restart as slow as on a loaded host, so that its peers reach STEPS
before it is back.

--start-together: at its first start, each rank waits (up to START_WAIT_S) once its Pipe is built
until every rank of every group has built its own (OUT/built_<replica>_<rank>), so that the
groups meet in their first quorum: on a loaded host a group that starts late was not there,
the other trained alone to STEPS, and no kill of a step before it ran.

--min-step-ms: each step lasts at least MS (the rest slept): a survivor training alone then
leaves the CPUs to the group restarting beside it, on a small test machine.

With --checkpoint-every N the script is the baseline instead: one replica group without
torchft, saving a sharded checkpoint (pipe.save) every N steps and resuming from the last one
(pipe.load) when the launcher restarts it.

Each rank writes its final state to OUT/final_<replica>_<rank>.pt, one JSON line per step to
OUT/log_<replica>_<rank>.jsonl (with the replicas the step's average held), and per start
the first quorum's time (a heal's, for a restarted group) to OUT/start_<replica>_<rank>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from pipeline import Pipe
from pipeline.replicas.tls import job_tls

WIDTH = 16
LR = 0.01
GROWTH_INTERVAL = 20  # a GradScaler's, with --scaler
INF_STEP = 1  # replica 1's batch of this step holds an inf, with --scaler
POINTS = ("forward", "backward", "step", "allreduce", "optimizer", "heal", "source", "end",
          "stall")


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one replica's share of one committed step: the same on every retry."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


@dataclass(frozen=True)
class Kill:
    replica: int
    rank: int
    step: int
    point: str


def parse_kills(text: str) -> list[Kill]:
    kills = []
    for spec in filter(None, text.split(",")):
        replica, rank, step, point = spec.split(":")
        if point not in POINTS:
            raise SystemExit(f"kill point {point!r}: use one of {', '.join(POINTS)}")
        kills.append(Kill(int(replica), int(rank), int(step), point))
    return kills


class Killer:
    """This rank's part in the job's kills: which one (if any) is armed at a step."""

    def __init__(self, out: str, kills: list[Kill], replica: int, rank: int,
                 after: str = "") -> None:
        self.out, self.kills, self.replica, self.rank = out, kills, replica, rank
        self.after = after  # --kill-after: the file that arms the kills
        self.last_everyone = -1  # the last committed step every replica took part in
        self.step = 0  # the step this rank runs now
        self.now: tuple[str, int] | None = None  # what is armed for it

    def marker(self, i: int) -> str:
        return os.path.join(self.out, f"killed_{i}")

    def done(self, i: int) -> dict[str, Any] | None:
        try:
            with open(self.marker(i)) as f:
                return dict(json.load(f))
        except FileNotFoundError:
            return None

    def next(self) -> int | None:
        return next((i for i in range(len(self.kills)) if self.done(i) is None), None)

    def arm(self, committed: int) -> None:
        """Arm what this rank does at the step it starts now."""
        self.step, self.now = committed, self._armed(committed)

    def fire(self, point: str) -> None:
        """SIGKILL this rank if `point` is armed now (SIGSTOP it for a stall, at `step`)."""
        if self.now is not None and self.now[0] == point:
            self.kill(self.now[1], self.step)
        elif self.now is not None and (self.now[0], point) == ("stall", "step"):
            self.kill(self.now[1], self.step, signal.SIGSTOP)

    def _armed(self, committed: int) -> tuple[str, int] | None:
        """("forward" | ... | "partner", i) when kill i is this rank's to run (or to be the
        collective's other end of) at this step."""
        i = self.next()
        if i is None or (self.after and not os.path.exists(self.after)):
            return None
        kill = self.kills[i]
        if kill.point in ("heal", "source") or kill.rank != self.rank or committed < kill.step:
            return None
        previous = self.done(i - 1) if i else None
        if previous is not None and self.last_everyone <= previous["step"]:
            return None  # the previous kill's group has not taken part in a step again
        if self.last_everyone < 0:
            # The groups have not met yet (one started late on a loaded host): a group lost
            # now would leave none holding the history it trained alone, and the job would
            # end, rightly, with an error instead of healing.
            return None
        if kill.replica == self.replica:
            return kill.point, i
        return ("partner", i) if kill.point == "allreduce" else None

    def heal_armed(self) -> int | None:
        """At a start: kill i if it is this rank's heal kill (its group was just lost)."""
        i = self.next()
        if i is None or not i:
            return None
        kill = self.kills[i]
        mine = (kill.replica, kill.rank) == (self.replica, self.rank)
        return i if mine and kill.point == "heal" else None

    def source_armed(self) -> int | None:
        """Kill i if it is this rank's source kill (the previous kill's group is healing)."""
        i = self.next()
        if i is None or not i or self.done(i - 1) is None:
            return None
        kill = self.kills[i]
        mine = (kill.replica, kill.rank) == (self.replica, self.rank)
        return i if mine and kill.point == "source" else None

    def finished(self) -> bool:
        """Every kill ran, and every replica took part in a step after the last one (an
        "end" kill comes after the loop: not waited for here)."""
        during = [i for i, kill in enumerate(self.kills) if kill.point != "end"]
        if not during:
            return True
        last = self.done(during[-1])
        return last is not None and self.last_everyone > last["step"]

    def kill(self, i: int, step: int, sig: int = signal.SIGKILL) -> None:
        """Mark kill i done (atomically: a reader sees all of it or nothing) and SIGKILL (or
        `sig`)."""
        staged = f"{self.marker(i)}.{os.getpid()}"
        with open(staged, "w") as f:
            json.dump({"t": time.time(), "step": step}, f)
        try:
            os.link(staged, self.marker(i))  # fails if another rank got there first
        except FileExistsError:
            return
        finally:
            os.unlink(staged)
        os.kill(os.getpid(), sig)


def _install_kills(pipe: Pipe, inner: torch.optim.Optimizer, killer: Killer,
                   rank: int) -> None:
    """Hooks that SIGKILL this rank at the armed point (the test reaches into the Manager:
    a kill must land inside torchft's own calls)."""
    layer = next(iter(pipe.partitions[pipe.local_stages[0]]))

    def forward_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        killer.fire("forward")
        if output.requires_grad and killer.now is not None and killer.now[0] == "backward":
            output.register_hook(lambda g: killer.fire("backward"))

    layer.register_forward_hook(forward_hook)
    inner.register_step_pre_hook(lambda opt, args, kwargs: killer.fire("optimizer"))
    assert pipe._ft is not None
    manager = pipe._ft.manager
    allreduce = manager.allreduce

    def killing_allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = allreduce(tensor, *args, **kwargs)  # launched: the collective is in flight
        if killer.now is not None and killer.now[0] in ("partner", "allreduce"):
            inside = os.path.join(killer.out, f"inside_{killer.now[1]}")
            if killer.now[0] == "partner":
                open(inside, "w").close()
            deadline = time.monotonic() + 10  # the kill waits until the other end is in
            while not os.path.exists(inside) and time.monotonic() < deadline:
                time.sleep(0.001)
            killer.fire("allreduce")
        return work

    manager.allreduce = killing_allreduce


def _kill_during_heal(pipe: Pipe, killer: Killer, i: int) -> None:
    """Kill i lands once the restarted rank has read part of its peer's checkpoint."""
    assert pipe._ft is not None
    transport = type(pipe._ft.manager._checkpoint_transport)

    def load(cls: Any, address: str, timeout: timedelta) -> object:
        # The heal's own request, on a TLS connection of the job's (tls).
        url = urlsplit(address)
        assert url.hostname is not None and url.port is not None
        seconds = timeout.total_seconds()
        sock = job_tls().client(socket.create_connection((url.hostname, url.port), seconds),
                                seconds)
        with sock:
            sock.sendall(f"GET {url.path}?{url.query} HTTP/1.0\r\n\r\n".encode())
            sock.recv(64)  # the transfer has begun
            # ".../checkpoint/<step>/full": the step the peer is at
            killer.kill(i, int(url.path.rstrip("/").split("/")[-2]))
        raise AssertionError("unreachable: the kill above ends the process")

    transport._load_from_address = classmethod(load)


def _kill_as_source(pipe: Pipe, killer: Killer) -> None:
    """Arm the source kill: when this rank is about to serve a heal to the previous kill's
    group, it waits (up to 30 s) until that group's other ranks logged their start (their heal
    done), then is killed, before its own heal request is answered."""
    assert pipe._ft is not None
    transport = pipe._ft.manager._checkpoint_transport
    send = transport.send_checkpoint

    def killing_send(*args: Any, **kwargs: Any) -> None:
        i = killer.source_armed()
        if i is not None:
            lost = killer.kills[i - 1]
            since = float((killer.done(i - 1) or {})["t"])
            others = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != killer.rank]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(
                    _started_since(killer.out, lost.replica, r, since) for r in others):
                time.sleep(0.01)
            killer.kill(i, int(kwargs.get("step", -1)))
        send(*args, **kwargs)

    transport.send_checkpoint = killing_send


def _started_since(out: str, replica: int, rank: int, since: float) -> bool:
    """Whether that rank logged a start (its first quorum done) after `since`."""
    try:
        with open(os.path.join(out, f"start_{replica}_{rank}.jsonl")) as f:
            return any(json.loads(line)["built"] + json.loads(line)["resume_s"] > since
                       for line in f if line.strip())
    except FileNotFoundError:
        return False


def _log_start(out: str, replica: int, rank: int, built: float, step: int) -> None:
    """When the Pipe was built, how long it then took to be ready to train (the first
    quorum, a heal for a group that starts late or again; or the checkpoint's load), and the
    step it starts from."""
    with open(os.path.join(out, f"start_{replica}_{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"built": built, "resume_s": time.time() - built,
                            "step": step}) + "\n")


def tp_batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """With --tp: the tensor-parallel MLP's data of one replica's share of one step."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _mesh_pipe(layout: str) -> Pipe:
    """--layout tp: each replica group is one stage over 2 tp ranks (column then row);
    replicate or fsdp: one stage on 2 dp ranks of the group, each taking half the rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests import models_tp  # run as a file: the repository must be on PYTHONPATH

    torch.distributed.init_process_group("gloo")
    if layout == "tp":
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
        return Pipe(models_tp.mlp(), balance=[6], chunks=2, mesh=mesh,
                    tp_plan=models_tp.mlp_plan(), fault_tolerance=True, timeout=60)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    return Pipe(models_tp.mlp(), balance=[6], chunks=2, mesh=mesh, data_parallel=layout,
                fault_tolerance=True, timeout=60)


def _full(state: Any) -> Any:
    """Every DTensor whole (each tp rank calls this on the same structure, in one order)."""
    from torch.distributed.tensor import DTensor

    return tree_map_only(DTensor, DTensor.full_tensor, state)


START_WAIT_S = 300.0  # --start-together: how long a rank waits for the others to be built


def _wait_for_every_group(out: str, replica: int, rank: int, replicas: int) -> None:
    """--start-together: mark this rank built, and at its first start wait until every rank
    of every group is (a restarted rank goes on at once)."""
    if os.path.exists(os.path.join(out, f"start_{replica}_{rank}.jsonl")):
        return
    with open(os.path.join(out, f"built_{replica}_{rank}"), "w") as f:
        f.write("built\n")
    ranks = int(os.environ["WORLD_SIZE"])
    wanted = [os.path.join(out, f"built_{g}_{r}") for g in range(replicas) for r in range(ranks)]
    deadline = time.monotonic() + START_WAIT_S
    while not all(map(os.path.exists, wanted)) and time.monotonic() < deadline:
        time.sleep(0.05)


def train(out: str, steps: int, kills: list[Kill], min_step_s: float, amp: bool,
          layout: str = "", schedule_lr: bool = False, deadline: float = 300.0,
          until: str = "", kill_after: str = "", exact: bool = False,
          restart_delay: float = 0.0, start_together: bool = False) -> None:
    replica = os.environ.get("REPLICA_GROUP_ID", "")  # unset in a spare until its Pipe is built
    if restart_delay and os.path.exists(os.path.join(
            out, f"start_{replica}_{os.environ['RANK']}.jsonl")):
        time.sleep(restart_delay)
    pipe = (_mesh_pipe(layout) if layout else
            Pipe(build_model(), balance=[2, 2], chunks=2, fault_tolerance=True, timeout=60))
    mlp = bool(layout)  # a mesh layout: the tests' tp MLP and its data
    rank = int(os.environ["RANK"])
    if start_together:
        _wait_for_every_group(out, pipe.replica_id, rank, pipe.num_replicas)
    killer = Killer(out, kills, pipe.replica_id, rank, kill_after)
    heal = killer.heal_armed()
    if heal is not None:
        _kill_during_heal(pipe, killer, heal)
    if any(kill.point == "source" for kill in kills):
        _kill_as_source(pipe, killer)
    started = time.time()
    inner = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _install_kills(pipe, inner, killer, rank)
    # fp32 under a GradScaler: scales are powers of two, so the scaled gradients round as
    # the plain ones do, and a reference without one gives the same bits.
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL) if amp else None
    scheduler = (torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.9**step)
                 if schedule_lr else None)
    optimizer = pipe.fault_tolerant(inner, scaler=scaler, state={"scheduler": scheduler}
                                    if scheduler is not None else None)
    _log_start(out, pipe.replica_id, rank, started, pipe.committed_steps)
    log = open(os.path.join(out, f"log_{pipe.replica_id}_{rank}.jsonl"), "a")  # noqa: SIM115
    # Train to `steps` (the library's loop: each step's quorum and heal before its batch is
    # picked, the end on a step every replica took), and on until a step every replica took
    # part in is committed after the last kill: a restarted group catches up (heals) before
    # the others stop, so all end at one step.
    loop = (pipe.training_steps(steps, deadline=deadline) if exact
            else _steps(pipe, steps, killer, deadline, until))
    for step in loop:
        killer.arm(step)
        begun = time.monotonic()
        x, y = (tp_batch if mlp else batch)(pipe.replica_id, step)
        if pipe.mesh is not None and pipe.mesh.dp_size > 1:  # this dp rank's rows
            x, y = x.chunk(pipe.mesh.dp_size)[pipe.mesh.dp_rank], y.chunk(
                pipe.mesh.dp_size)[pipe.mesh.dp_rank]
        if amp and (pipe.replica_id, step) == (1, INF_STEP):
            x[0, 0] = float("inf")
        loss = pipe.step(x, y, nn.MSELoss(), scaler=scaler)
        killer.fire("step")
        optimizer.step()
        optimizer.zero_grad()
        committed = pipe.last_step_committed  # (the count may also move by a heal)
        if committed and scheduler is not None:
            scheduler.step()
        if committed and len(pipe.participants) == pipe.num_replicas:
            killer.last_everyone = step
        log.write(json.dumps({"t": time.time(), "step": step, "loss": loss.item(),
                              "committed": committed, "participants": pipe.num_participants,
                              "members": list(pipe.participants)}) + "\n")
        log.flush()
        time.sleep(max(0.0, begun + min_step_s - time.monotonic()))
    killer.arm(pipe.committed_steps)
    killer.fire("end")
    torch.save({"model": _full(pipe.state_dict()) if mlp else pipe.state_dict(),
                "optimizer": _full(optimizer.state_dict()) if mlp else optimizer.state_dict(),
                "committed_steps": pipe.committed_steps,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None},
               os.path.join(out, f"final_{pipe.replica_id}_{rank}.pt"))
    pipe.close()


def _steps(pipe: Pipe, steps: int, killer: Killer, deadline: float,
           until: str = "") -> Iterator[int]:
    """pipe.training_steps(steps); with kills to run or `until`, on past STEPS until every
    kill ran (and the step the replicas end at is reached), ending after a step that every
    replica took: each group sees that step alike, so all end on it."""
    if not killer.kills and not until:
        yield from pipe.training_steps(steps, deadline=deadline)
        return
    # A total never reached: the loop would hold at one (training_steps stops there until
    # every group is back), and a survivor must go on alone while a group is lost.
    for step in pipe.training_steps(1 << 40, deadline=deadline):
        yield step
        everyone = pipe.last_step_committed and len(pipe.participants) == pipe.num_replicas
        stop = _stop_at(killer.out, until, pipe.committed_steps)
        if (everyone and pipe.committed_steps >= steps and killer.finished()
                and stop is not None and pipe.committed_steps >= stop):
            return


def _stop_at(out: str, until: str, committed: int) -> int | None:
    """The step every replica ends at: now without `until`; with it, None until the file
    exists, then 5 steps on from where the first replica to see it was."""
    if not until:
        return committed
    if not os.path.exists(until):
        return None
    mark = os.path.join(out, "stop_at")
    staged = f"{mark}.{os.getpid()}"
    with open(staged, "w") as f:
        f.write(str(committed + 5))
    try:
        os.link(staged, mark)  # the first replica's word stands
    except FileExistsError:
        pass
    finally:
        os.unlink(staged)
    with open(mark) as f:
        return int(f.read())


def train_from_checkpoints(out: str, steps: int, kills: list[Kill], every: int) -> None:
    """The baseline: one pipeline, a sharded checkpoint every `every` steps, resumed from."""
    pipe = Pipe(build_model(), balance=[2, 2], chunks=2, timeout=60)
    started = time.time()
    rank = int(os.environ["RANK"])
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    path = os.path.join(out, "checkpoint")
    step = 0
    if os.path.exists(path):
        pipe.load(path, optimizer)
        # The step count is AdamW's own, saved with its state: no second file to agree with.
        step = int(next(iter(optimizer.state.values()))["step"])
    _log_start(out, 0, rank, started, step)
    killer = Killer(out, kills, 0, rank)
    killer.last_everyone = steps  # one replica: every step has everyone
    log = open(os.path.join(out, f"log_0_{rank}.jsonl"), "a")  # noqa: SIM115
    while step < steps:
        killer.arm(step)
        x, y = batch(0, step)
        loss = pipe.step(x, y, nn.MSELoss())
        killer.fire("step")  # the baseline is killed between its backward and its step
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        entry = {"t": time.time(), "step": step - 1, "loss": loss.item(), "committed": True,
                 "participants": 1, "members": [0]}
        if step % every == 0:
            pipe.save(path, optimizer)
            entry["saved_s"] = time.time() - entry["t"]
        log.write(json.dumps(entry) + "\n")
        log.flush()
    torch.save({"model": pipe.state_dict(), "optimizer": optimizer.state_dict(),
                "committed_steps": step}, os.path.join(out, f"final_0_{rank}.pt"))
    pipe.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill", default="")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--min-step-ms", type=float, default=0.0)
    parser.add_argument("--scaler", action="store_true")
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--layout", choices=("tp", "replicate", "fsdp"), default="")
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--until", default="")
    parser.add_argument("--kill-after", default="")
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--restart-delay", type=float, default=0.0)
    parser.add_argument("--start-together", action="store_true")
    ns = parser.parse_args(argv)
    kills = parse_kills(ns.kill)
    if ns.checkpoint_every:
        train_from_checkpoints(ns.out, ns.steps, kills, ns.checkpoint_every)
    else:
        train(ns.out, ns.steps, kills, ns.min_step_ms / 1000, ns.scaler, ns.layout,
              ns.scheduler, ns.deadline, ns.until, ns.kill_after, ns.exact,
              ns.restart_delay, ns.start_together)


if __name__ == "__main__":
    main()
