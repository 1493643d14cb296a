"""Pipeline replicas that survive a lost rank: torchft's step protocol around a Pipe's stages."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from pipeline.comm.handed import Handed
from pipeline.errors import PipeConfigError
from pipeline.parallel.tensor_parallel import local_tensor
from pipeline.replicas import auth as ft_auth
from pipeline.replicas import heal_state, hold
from pipeline.replicas import lineage as ft_lineage
from pipeline.replicas.environment import (
    LOG_ENV,
    NUM_REPLICAS_ENV,
    check_installed,
    read_environment,
    warnings_to_stderr,
)
from pipeline.replicas.heal import check_heal
from pipeline.replicas.record import JobRecord, NotLatest
from pipeline.replicas.spares import await_replica_id

__all__ = ["FaultTolerance"]

_log = logging.getLogger(__name__)


def _weights_only_transport(timeout: timedelta) -> Any:
    """The heal transport (heal_transport): a peer's checkpoint read as plain data
    (`weights_only=True`, torchft's own unpickles it), under the job's TLS."""
    from pipeline.replicas.heal_transport import HealTransport

    return HealTransport(timeout)


class FaultTolerance:
    """One torchft Manager per pipeline rank: rank r of every replica group holds the same
    stage(s), so the Manager's managed process group joins exactly the ranks whose gradients
    must be averaged, and its checkpoint transport heals a rank from its peer of that stage."""

    def __init__(self, pipe: Any, timeout: float) -> None:
        check_installed("Pipe(fault_tolerance=True)")
        if pipe.mesh is None and pipe.group is not None:
            raise PipeConfigError(
                f"Pipe(fault_tolerance=True) runs the replica group's whole world as one "
                f"pipeline (or dp x pp x tp with mesh=); group= is not taken (got "
                f"{pipe.group!r}): drop it, or pass mesh= with dimensions of ('dp', 'pp', 'tp')")
        if pipe.multi_batch:
            raise PipeConfigError(
                f"Pipe(fault_tolerance=True) commits once per batch, but schedule "
                f"{pipe._probe.name!r} steps the optimizer inside the schedule: use a flushing "
                f"schedule (1f1b, gpipe, interleaved, zb-*)")
        from torchft.process_group import ProcessGroupGloo

        # Rank r of every replica group holds the same stage and tp shard (every group lays
        # its world out alike), so the Manager's group of rank r joins exactly the peers whose
        # gradients and state are r's.
        # A group of one process (`--nproc 1`) holds every stage: rank 0 of 1.
        rank, world_size = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                            if pipe.world else (0, 1))
        # A spare group (`--spares`) waits here, built, for the id of a lost group: the
        # latest point, since the Manager below is named by it.
        await_replica_id(timeout, rank)
        self.replica_id, self.num_replicas, lighthouse = read_environment()
        wait = timedelta(seconds=timeout)
        self._pipe = pipe
        self._wait = wait
        self.holding_said = False  # the warning that this group holds at its total was given
        self._optimizer: torch.optim.Optimizer | None = None
        self._quorum_started = False
        self._stepped = False  # pipe.step ran since the last commit
        self.participants: tuple[int, ...] = ()
        self.last_committed = False  # whether the last optimizer.step() committed its step
        self._scaler: Any = None  # the GradScaler given to fault_tolerant, if any
        # The history of committed steps this replica holds (ft_lineage): a heal carries it.
        self.lineage = 0
        # The job's record of which history each step extends (record), where the
        # launcher keeps one; every rank writes its count there (its group holds what all
        # its ranks hold).
        self.rank = rank
        self._saved: str | None = None  # where this rank last saved (pipe.save), if it did
        self.record = JobRecord.from_environment(self.replica_id, timeout, rank,
                                                 self.last_state)
        self._writes_count = True
        # The digest of this rank's state (ft_lineage.state_digest) at its committed count,
        # once known: each commit's lineage carries it.
        self.digest: int | None = None
        if os.environ.get(LOG_ENV) and not logging.getLogger().handlers:
            warnings_to_stderr()
        # Quorum at the start of a step and healing before its forward (use_async_quorum
        # False): a restarted group computes its first gradients at its peer's weights. The
        # step count starts from the peers' (init_sync): weights agree from step 0.
        # Its manager, lighthouse and heals this library's, on loopback (or
        # PIPELINE_FT_BIND), every connection under the job's TLS (tls).
        self.manager = ft_auth.build_manager(
            pg=ProcessGroupGloo(timeout=wait), load_state_dict=None, state_dict=None,
            min_replica_size=1, use_async_quorum=False, timeout=wait, quorum_timeout=wait,
            connect_timeout=wait, rank=rank, world_size=world_size,
            checkpoint_transport=_weights_only_transport(wait),
            lighthouse_addr=lighthouse, replica_id=f"pipeline_replica_{self.replica_id}")
        self.manager.register_state_dict_fn("pipe", self._load_model, self._model_state)
        self.manager.register_state_dict_fn("lineage", self._load_lineage,
                                            lambda: {"lineage": self.lineage})

    # -- what heals a rank (heal_state): its stage's weights, lineage and optimizer's state --
    def _model_state(self) -> dict[str, Any]:
        return heal_state.model_state(self._pipe)

    def _load_model(self, state: dict[str, Any]) -> None:
        heal_state.load_model(self._pipe, state)

    def _load_lineage(self, state: dict[str, Any]) -> None:
        self.lineage = int(state["lineage"])

    def _optimizer_state(self) -> dict[str, Any]:
        assert self._optimizer is not None
        return heal_state.optimizer_state(self._optimizer)

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        assert self._optimizer is not None
        heal_state.load_optimizer(self._optimizer, state)

    def wrap(self, optimizer: torch.optim.Optimizer, scaler: Any = None,
             state: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
        """`optimizer`, stepping only when the quorum commits (torchft's OptimizerWrapper);
        with `scaler`, stepping through it after the average, its state healed too; every
        object of `state` (a learning-rate scheduler, a data loader's position: anything with
        `state_dict()` and `load_state_dict()`) is carried by a heal under its name."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PipeConfigError(f"pipe.fault_tolerant(optimizer) takes a torch.optim."
                                  f"Optimizer; got {type(optimizer).__name__}")
        if self._optimizer is not None:
            raise PipeConfigError("pipe.fault_tolerant(...) was already called on this Pipe: "
                                  "wrap one optimizer, the one holding pipe.parameters()")
        owned = {id(p) for p in self._pipe.parameters()}
        foreign = [i for i, g in enumerate(optimizer.param_groups)
                   if any(id(p) not in owned for p in g["params"])]
        if foreign:
            raise PipeConfigError(
                f"pipe.fault_tolerant(optimizer): param group(s) {foreign} hold parameters "
                f"that are not this rank's (pipe.parameters()); build the optimizer on "
                f"pipe.parameters()")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise PipeConfigError(f"pipe.fault_tolerant(optimizer, scaler=...) takes a "
                                  f"torch.amp.GradScaler; got {type(scaler).__name__}")
        state = dict(state or {})
        for name, obj in state.items():
            taken = name in ("pipe", "lineage", "optimizer", "scaler", "torchft")
            if taken or not callable(getattr(obj, "state_dict", None)) or not callable(
                    getattr(obj, "load_state_dict", None)):
                raise PipeConfigError(
                    f"pipe.fault_tolerant(..., state={{{name!r}: ...}}): each entry must have "
                    f"state_dict() and load_state_dict() (got {type(obj).__name__}) under a "
                    f"name other than pipe, lineage, optimizer, scaler and torchft")
        self._optimizer = optimizer
        self.manager.register_state_dict_fn("optimizer", self._load_optimizer,
                                            self._optimizer_state)
        if scaler is not None and scaler.is_enabled():
            # Its scale and growth tracker: a healed replica must skip and grow as its peers.
            self.manager.register_state_dict_fn("scaler", scaler.load_state_dict,
                                                scaler.state_dict)
        else:
            scaler = None
        self._scaler = scaler
        for name, obj in state.items():  # a scheduler's step count, say: healed with the rest
            self.manager.register_state_dict_fn(name, obj.load_state_dict, obj.state_dict)
        from pipeline.replicas.optimizer import ReplicaOptimizer

        wrapped = ReplicaOptimizer(self.manager, optimizer, self, scaler)
        # The first quorum now: a group that starts late or again heals here, so its
        # committed_steps (and the data the loop picks by it) are its peers' from the start.
        self._quorum()
        return wrapped

    # -- the step protocol ---------------------------------------------------------------------
    def before_step(self, scaler: Any = None) -> None:
        """The quorum for this step (healing this rank first if it is behind), unless the
        last commit started it already. `scaler`: the one given to this pipe.step."""
        if self._optimizer is None:
            raise PipeConfigError(
                "Pipe(fault_tolerance=True) commits steps through its optimizer: wrap it "
                "before the first step, optimizer = pipe.fault_tolerant(torch.optim.AdamW("
                "pipe.parameters()))")
        if scaler is not None and scaler.is_enabled() and scaler is not self._scaler:
            # Stepped by the user, the scaler would skip or grow on this replica's gradients
            # alone, before the average the other replicas wait in.
            raise PipeConfigError(
                "pipe.step(..., scaler=scaler) under fault tolerance: give the same scaler to "
                "pipe.fault_tolerant(optimizer, scaler=scaler) and call optimizer.step() "
                "alone (it runs scaler.step and scaler.update after the cross-replica average)")
        if not self._quorum_started:
            before = self.committed_steps
            self._quorum()
            if self.committed_steps != before:
                # The loop picked this step's batch for `before`: trained now, the step would
                # average that batch into another step's gradients, silently.
                raise PipeConfigError(
                    f"replica group {self.replica_id} was healed at the start of pipe.step "
                    f"(from step {before} to {self.committed_steps}), after the loop had "
                    f"picked its batch for step {before}: loop over pipe.training_steps(total), "
                    f"which heals before it yields the step to pick the batch by")
        self._stepped = True

    def _quorum(self) -> None:
        """Start this step's quorum (and heal) unless it is started; a rank healed by it
        shows in the record at once what it holds (the launcher may need to know before its
        next commit: restart a lost peer, or end the job; its group holds the history once
        every one of its ranks does)."""
        if not self._quorum_started:
            transport = getattr(self.manager, "_checkpoint_transport", None)
            heals = getattr(transport, "heals", None)  # our HealTransport's
            before = len(heals) if heals is not None else 0
            self.manager.start_quorum()
            self._quorum_started = True
            if heals is not None and len(heals) > before:
                check_heal(self, heals[-1])
            if self.record is not None and self._writes_count:
                self.record.committed(self.committed_steps, self.lineage)

    def state_tensors(self) -> list[torch.Tensor]:
        """This rank's stage weights, in order (its shards under tp): what its digest covers."""
        return [local_tensor(v) for v in self._pipe.state_dict().values()
                if isinstance(v, torch.Tensor)]

    def _digest_now(self) -> int:
        self.digest = ft_lineage.state_digest(self.state_tensors())
        return self.digest

    def last_state(self) -> str:
        """Where this rank's last committed state is, for a message of a job that ends."""
        saved = (f"its last save: {self._saved}, resume with pipe.load" if self._saved
                 else "it saved none in this run (pipe.save)")
        return (f"Replica group {self.replica_id} rank {self.rank} held "
                f"{self.committed_steps} committed steps in memory, now lost; {saved}")

    def saved(self, path: str) -> None:
        """pipe.save wrote this rank's committed state to `path`."""
        self._saved = path

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average this rank's gradients over the same stage of every replica in the quorum
        (one flat buffer; a replica that is not participating contributes zeros, torchft's
        rule). An error is recorded by the Manager, and the step is then not committed."""
        if not self._stepped:
            raise PipeConfigError("optimizer.step() before any pipe.step(...) in this step: "
                                  "run pipe.step first, then optimizer.step()")
        # Under tp, this rank's shards: the peers of rank r hold the same ones.
        grads = [local_tensor(p.grad) if p.grad is not None
                 else torch.zeros_like(local_tensor(p)) for p in params]
        # This replica's one-hot rides in the same buffer: averaged, its nonzero entries are
        # exactly the replicas whose gradients the average holds (a replica torchft does not
        # count as participating sends zeros, its one-hot too).
        here = torch.zeros(self.num_replicas, dtype=torch.float32)
        here[self.replica_id] = 1.0
        device = grads[0].device if grads else here.device
        dtype = grads[0].dtype if grads else here.dtype
        # So do the replicas' lineages: replicas that meet at one step after committing steps
        # apart hold other weights, which no heal would make equal (torchft heals only a
        # replica behind the others).
        lineage = ft_lineage.encode(self.lineage, self.replica_id, self.num_replicas, dtype,
                                    device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [here.to(device, dtype), lineage])
        held = Handed([flat])
        self.manager.allreduce(flat).wait()
        if self.manager.errored() is None:
            # gloo lets go of it before we do (pipeline/comm/handed.py). Not after an error:
            # the failed work may hold it until the next quorum rebuilds the group.
            held.settle()
        offset = 0
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                n = g.numel()
                if p.grad is None:  # unused here, used elsewhere: the average still applies
                    p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(flat[offset:offset + n].view_as(g))
                offset += n
        if self.manager.errored() is not None:  # the buffer may be torn: not committed
            self.participants = ()
            return
        ones = flat[offset:offset + self.num_replicas]
        self.participants = tuple(int(r) for r in ones.nonzero().flatten())
        self._check_ids(ones)
        self._check_lineages(ft_lineage.decode(flat[offset + self.num_replicas:],
                                               self.participants))
        if len(self.participants) < self.num_replicas:
            # torchft's rule: the average is over the replicas present, so the step's batch
            # is smaller than the job's (fewer replicas' batches).
            _log.warning("step %d: averaged over %d of %d replicas (%s)", self.committed_steps,
                         len(self.participants), self.num_replicas,
                         ", ".join(map(str, self.participants)) or "none")

    def _check_ids(self, ones: torch.Tensor) -> None:
        """Refuse two groups that run as one replica id (started by hand with the same
        REPLICA_GROUP_ID): torchft counts both, so the averaged one-hot holds 2 / n at their
        slot, where every other replica's holds 1 / n."""
        counts = (ones.double() * self.num_participants).round().long().tolist()
        twice = [r for r, c in enumerate(counts) if c > 1]
        if twice:
            self.manager.report_error(PipeConfigError(f"replica id {twice[0]} twice"))
            self.participants = ()
            raise PipeConfigError(
                f"{counts[twice[0]]} replica groups run as REPLICA_GROUP_ID={twice[0]} (of "
                f"{NUM_REPLICAS_ENV}={self.num_replicas}): each group needs its own id in "
                f"[0, {self.num_replicas}); they would train on the same data as one replica")

    def _check_lineages(self, lineages: dict[int, int]) -> None:
        """Refuse a step whose replicas hold other histories: none commits it, and every
        replica whose history is not the lowest-numbered participant's exits, so that its
        launcher restarts it and it heals from that replica."""
        if len(set(lineages.values())) <= 1:
            return
        first = min(lineages)
        apart = sorted(r for r, v in lineages.items() if v != lineages[first])
        why = (f"step {self.committed_steps}: replica(s) {apart} committed steps apart from "
               f"replica {first} (the lighthouse dropped a live replica whose heartbeats "
               f"stalled, and each went on alone at the same step); the step is not committed")
        self.manager.report_error(ft_lineage.ReplicasDiverged(why))
        self.participants = ()
        if self.replica_id in apart:
            raise ft_lineage.ReplicasDiverged(
                f"{why}. Replica group {self.replica_id} stops so that its launcher restarts "
                f"it and it heals from replica {first}; a longer heartbeat timeout "
                f"(`python -m pipeline.launch --heartbeat-timeout`) makes this rarer on a "
                f"loaded host")

    def commit(self, apply: Callable[[], None]) -> bool:
        """Apply the step when every rank of this replica group agrees and it extends the
        job's history; the next step starts a new quorum whatever the outcome."""
        step = self.committed_steps
        if self.digest is None:
            self._digest_now()
        assert self.digest is not None
        after = ft_lineage.next_lineage(self.lineage, step, self.participants, self.digest)
        theirs = None
        if self.record is not None and self.participants:
            theirs = self.record.conflict(step, after)
            if theirs is not None:  # this group's ranks all see it: none commits
                self.manager.report_error(NotLatest(f"step {step} extends another history"))
        try:
            ok = bool(self.manager.should_commit())
        finally:
            self._quorum_started = self._stepped = False
        if ok and self.record is not None:
            lost = self.record.claim(step, after)
            if lost is not None:
                # Another quorum committed this step from other weights between the check
                # and now: this group's count already moved on, so it restarts and heals.
                raise ft_lineage.ReplicasDiverged(
                    f"step {step}: replica group {self.replica_id} and another quorum both "
                    f"committed it from other histories at the same moment; this group stops "
                    f"so that its launcher restarts it and it heals from the job's history")
        self.last_committed = ok
        if ok:
            apply()
            self.lineage = after
            digest = self._digest_now()
            if self.record is not None:
                held = self.record.digest(self.committed_steps, digest)
                if held != digest:
                    raise ft_lineage.ReplicasDiverged(
                        f"step {step}: replica group {self.replica_id} rank {self.rank} "
                        f"committed it from the job's history, but its state after it "
                        f"(digest {digest}) is not the one the history holds ({held}): this "
                        f"group stops so that its launcher restarts it and it heals")
            if self.record is not None and self._writes_count:
                self.record.committed(self.committed_steps, self.lineage)
        elif theirs is not None:
            _log.warning("step %d: replica group %d does not hold the job's history (another "
                         "group committed this step from other weights); not committed, it "
                         "waits for a quorum with a group that holds it, which heals it",
                         step, self.replica_id)
        else:
            _log.warning("step %d not committed (a replica failed or the quorum changed); "
                         "it is taken again", step)
        return ok

    def training_steps(self, total: int, deadline: float) -> Iterator[int]:
        """The step to train next until `total` are committed, then hold (hold.py)."""
        return hold.training_steps(self, total, deadline)

    def agree(self, yes: bool) -> bool:
        """Whether every rank of this replica group says `yes` (through its manager server,
        committing nothing)."""
        return bool(self.manager._client.agree(self.rank, yes, self._wait))

    @property
    def committed_steps(self) -> int:
        return int(self.manager.current_step())

    @property
    def num_participants(self) -> int:
        return int(self.manager.num_participants())

    def close(self) -> None:
        self.manager.shutdown(wait=False)
