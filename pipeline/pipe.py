"""Pipe: wrap a model (an nn.Sequential, or one split from its graph) and train it over devices."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pipeline import assembly
from pipeline.auto_schedule import AutoSchedule, check_memory
from pipeline.comm import bootstrap
from pipeline.comm.process_group import PeerFailure, ProcessTransport
from pipeline.comm.transport import PipelineAborted
from pipeline.errors import PipeConfigError, PipelineError, PipeTypeError
from pipeline.parallel import tensor_parallel
from pipeline.parallel.clipping import clip_grad_norm
from pipeline.parallel.scaling import agree_on_overflow
from pipeline.replicas.fault_tolerant_pipe import FaultTolerantPipe
from pipeline.replicas.replica import FaultTolerance
from pipeline.runtime import batches, weighting
from pipeline.runtime.batches import one_at_a_time
from pipeline.runtime.context import CallerState
from pipeline.runtime.microbatch import backward_inputs, gather
from pipeline.runtime.stage import LossFn, StepInputs, StepResult
from pipeline.runtime.syncs import StepSyncs
from pipeline.runtime.tokens import cuts as token_cuts
from pipeline.runtime.tokens import padded, restored
from pipeline.runtime.weighting import LossWeight
from pipeline.splitting import checks, config
from pipeline.splitting.traced import SplitModel
from pipeline.state.pipe_state import PipeState
from schedules import Schedule, Timeline

__all__ = ["Pipe", "PipeConfigError", "PipelineError"]


class Pipe(PipeState, FaultTolerantPipe, assembly.Assembled, nn.Module):
    """Pipeline-parallel wrapper of an `nn.Sequential` or a model split from its graph.

    The model's own layers (and Parameter objects) are registered under their original names,
    so `model.parameters()`, `pipe.parameters()` and `state_dict()` keys are interchangeable.
    See docs/pipe.md for the arguments; `step` trains, `forward` infers.
    """

    _io: SplitModel | None  # a model split from its graph (see pipeline/splitting/split.py)

    def __init__(
        self,
        model: nn.Module,
        balance: Sequence[int] | str | None = None,
        *,
        stages: int | None = None,
        devices: Sequence[str | torch.device] | None = None,
        chunks: int = 1,
        schedule: str | Schedule = "1f1b",
        checkpoint: str = "except_last",
        sample: Any = None,
        timeout: float = 300.0,
        track_memory: bool = False,
        group: Any = None,
        mesh: Any = None,
        data_parallel: str = "replicate",
        param_init: str | bootstrap.ParamInit = "reset",
        deferred_batch_norm: bool | str = False,
        broadcast_buffers: bool = True,
        example_inputs: Any = None,
        split_points: Sequence[str] | None = None,
        tp_plan: dict[str, Any] | None = None,
        fault_tolerance: bool = False,
        tokens: bool = False,
        auto_memory: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        check_memory(auto_memory, schedule)  # before any work (the ranks' count: below)
        model, balance, stages = config.split_model(model, example_inputs, split_points,
                                                    balance, stages, devices, schedule,
                                                    group, mesh, tp_plan)
        self.timeout = config.check_arguments(model, chunks, checkpoint, param_init, timeout,
                                              devices)
        self.chunks, self.checkpoint, self.track_memory = chunks, checkpoint, track_memory
        self._schedule_arg, self._tokens = schedule, tokens  # tokens: see runtime/tokens.py
        # The last step's timeline, made when first read: on a GPU that waits for the step's
        # CUDA events, which a step itself never does (it returns once its work is queued).
        self._timeline_of: Callable[[], Timeline] | None = None
        self._stats: list[dict[str, int]] = []
        self._warned_padding = False  # once per Pipe (see _context)
        assembly.lay_out(self, model, balance, stages, devices, schedule, sample, group, mesh,
                         data_parallel, deferred_batch_norm, tp_plan)
        assembly.place_layers(self, model, param_init, chunks, checkpoint, data_parallel)
        assembly.start_runtime(self, chunks, data_parallel, broadcast_buffers,
                               deferred_batch_norm)
        assembly.link_ties(self)
        self._ft = FaultTolerance(self, self.timeout) if fault_tolerance else None  # torchft
        # schedule="auto": what runs, measured at the first step (pipeline/auto_schedule.py)
        self.auto = AutoSchedule(self, chunks, auto_memory) if schedule == "auto" else None

    # -- configuration --------------------------------------------------------------------------
    def program(self, chunks: int | None = None, *, batches: int = 1, scaler: bool = False,
                train: bool = True) -> Schedule:
        """The program a step of `chunks` micro-batches (default the Pipe's) x `batches`
        batches runs: the lowered schedule with the step's syncs placed as actions (tied
        weights refreshed and their gradients added, the dp reductions launched and awaited,
        the GradScaler's overflow agreed across processes with `scaler=True`), validated; with
        `train=False`, the forward-only program `pipe(x)` runs. See schedules/program.py."""
        return self._programs.program(self.chunks if chunks is None else chunks,
                                      batches=batches, scaler=scaler, train=train)

    @property
    def multi_batch(self) -> bool:
        """Whether `step_many` runs several batches as one schedule (weight-versioned, 2BW)."""
        return self._programs.multi_batch

    # -- running --------------------------------------------------------------------------------
    def _run(self, program: Schedule, step: StepInputs, optimizer: Any = None) -> StepResult:
        """Run `program` (every rank's part of it held here) with what it needs around it:
        2BW's weight versions, deferred BatchNorm's statistics, dp's buffers."""
        result = StepResult()
        devices = [rt.device for rt in self._executor.runtimes]
        for d in {d for d in devices if d.type == "cuda"}:
            torch.cuda.reset_peak_memory_stats(d)
        dp = program.syncs is not None and program.syncs.dp and self._replicas is not None
        if step.versions is not None:
            step.versions.open(program.num_batches, optimizer)
        try:
            if self._batch_norm is not None:
                self._batch_norm.begin()
            self._timeline_of, self._stats = self._executor.run(program, step, result,
                                                                self.checkpoint)
            if self._tp_plan is not None:
                tensor_parallel.grads_as_params(self.parameters())
            if self._batch_norm is not None:
                self._batch_norm.commit()
            if dp and self._replicas is not None:
                self._replicas.finish()  # dp rank 0's buffers, committed statistics included
        except BaseException as exc:
            if step.versions is not None:
                step.versions.abandon()
            if dp and self._replicas is not None:
                self._replicas.abandon(exc)
            raise
        if step.versions is not None:
            step.versions.close()
        for stats, d in zip(self._stats, devices, strict=True):
            if d.type == "cuda":  # ranks sharing a device report that device's peak
                stats["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(d)
        return result

    def _share(self, values: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Last stage's result to every rank (multi-process); as is in one process."""
        return self._executor.share(values, shape, self._probe.rank_of(len(self.balance) - 1))

    def forward(self, x: Any, *, chunks: int | None = None, tokens: Any = None) -> Any:
        """Inference: the pipelined forward of `x`, equal to `model(x)` (no autograd graph),
        in `chunks` micro-batches (default the Pipe's; a batch smaller than that needs fewer).

        Multi-process: every rank passes the same `chunks`; returns the output on the last
        stage's rank and None on the others.
        """
        chunks = self.chunks if chunks is None else chunks
        if self._io is not None:  # None: a rank without the first stage
            x = self._io.prepare(x, chunks)
        self._agreement.check(self, [(x, None)])
        cut = token_cuts(self, [(x, None)], tokens, chunks)[0]
        inputs, _, _ = batches.share(self, x, None, None, chunks, cut=cut)
        step = StepInputs(inputs, None, None, [1.0] * chunks, [False] * chunks,
                          self._seed(), caller=CallerState.capture(),
                          syncs=StepSyncs(ties=self._tie_link))
        with torch.no_grad():  # the program refreshes the copies of tied weights
            result = self._run(self.program(chunks, train=False), step)
        if not result.outputs:
            return None  # multi-process: the output lives on the last stage's rank
        outputs = padded(cut, [result.outputs[m] for m in range(chunks)])  # 0-dim: as loss is
        return restored(cut, self._io.merge(outputs) if self._io is not None else gather(outputs))

    def step(self, x: Any, target: Any, loss_fn: LossFn, *,
             loss_reduction: str | None = None, loss_weight: LossWeight | None = None,
             scaler: Any = None, tokens: Any = None,
             losses: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of one batch under the schedule; returns the batch's loss.

        Leaves in each parameter's `.grad` what `loss_fn(model(x), target).backward()` would
        (accumulating onto what is there), for `loss_fn` reducing by mean or by sum: a loss
        module's `reduction` says which; for a plain function pass `loss_reduction="sum"`
        (default "mean"). A mean is weighted by what it averages over: rows, or the counted
        targets of a cross-entropy or NLL loss (`ignore_index`, class weights), or
        `loss_weight(target)` for any other (`lambda t: (t != -100).sum()`), or what a split
        model's own loss (`out.loss`) counts; see pipeline/runtime/weighting.py. With
        `schedule="2bw"` the gradients are taken at the previous step's weights
        (PipeDream-2BW). Runs under the caller's autocast. With a `torch.amp.GradScaler`, each
        micro-batch's loss is scaled before its backward (the returned loss is not):
        `scaler.step(optimizer)` and `scaler.update()` follow as in plain training.

        `losses`, a list, is cleared and given each micro-batch's own loss (`loss_fn`'s value,
        unweighted, detached; NaN for one where nothing was counted), in micro-batch order, on
        the ranks that compute the loss (every rank in one process), as torch.distributed.
        pipelining's `step(..., losses=)`; elsewhere it is left as it is.
        """
        if losses is not None and not isinstance(losses, list):
            raise PipeTypeError(f"losses must be a list for the step to fill with each "
                                f"micro-batch's loss (got {type(losses).__name__}): pass "
                                f"losses=[]")
        return self._steps([(x, target)], loss_fn, None, loss_reduction, loss_weight,
                           scaler, tokens, losses)[0]

    def step_many(self, batches: Iterable[tuple[Any, Any]], loss_fn: LossFn,
                  optimizer: torch.optim.Optimizer, *, loss_reduction: str | None = None,
                  loss_weight: LossWeight | None = None,
                  scaler: Any = None) -> list[torch.Tensor]:
        """Train on several batches, calling `optimizer.step()` after each; returns the losses.

        Under a multi-batch schedule (`2bw`) the batches run as one schedule without a flush,
        each stage updating its weights right after its share of each batch (numerically the
        same as `step` followed by `optimizer.step()` and `optimizer.zero_grad()`, batch after
        batch). Other schedules run one batch at a time, and take a `scaler` (GradScaler) as
        `step` does, stepping through it. Gradients are left cleared (None).
        """
        pairs = checks.check_batches(batches)
        checks.check_optimizer(optimizer)
        # A tied weight's copy would update after its owner, and replicas would step before
        # averaging, inside a flush-free schedule: with ties or dp, 2BW runs batch by batch
        # (the same update rule, one flush per batch).
        if not self.multi_batch or self._ties or self._replicas:
            return one_at_a_time(
                lambda x, t: self.step(x, t, loss_fn, loss_reduction=loss_reduction,
                                       loss_weight=loss_weight, scaler=scaler),
                pairs, optimizer, scaler)
        if scaler is not None:
            raise PipeConfigError(
                f"schedule {self._probe.name!r} steps the optimizer inside the schedule, where "
                f"a GradScaler cannot skip a step: train it in fp32 or bf16 (no scaler), or "
                f"use pipe.step with a flushing schedule")
        optimizer.zero_grad(set_to_none=True)
        return self._steps(pairs, loss_fn, optimizer, loss_reduction, loss_weight)

    def _steps(self, pairs: list[tuple[Any, Any]], loss_fn: LossFn,
               optimizer: torch.optim.Optimizer | None,
               loss_reduction: str | None = None, loss_weight: LossWeight | None = None,
               scaler: Any = None, tokens: Any = None,
               losses: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Check, build the program, run it, return the loss (and each micro-batch's in
        `losses`): everything a step does across ranks is an action of the program
        (schedules/program.py)."""
        checks.check_loss_fn(loss_fn)
        if self._ft is not None:  # the quorum (and a heal) before anything is computed
            self._ft.before_step(scaler)
        how = weighting.resolve(loss_fn, loss_reduction, loss_weight, self._io,
                                whole_batch=self.chunks == 1 and self._replicas is None)
        if self._io is not None:  # the model's inputs flattened, its outputs rebuilt
            # None: a rank without the first stage (multi-process), as for nn.Sequential
            pairs = [(self._io.prepare(x), t) for x, t in pairs]
            loss_fn = self._io.with_outputs(loss_fn)
        self._agreement.check(self, pairs)
        if self._replicas is not None:
            self._replicas.agree(self, len(pairs))
        scaler = scaler if scaler is not None and scaler.is_enabled() else None
        program = self.program(self.chunks, batches=len(pairs), scaler=scaler is not None)
        step = batches.step_inputs(self, program, pairs, loss_fn, how, scaler, self._seed(),
                                   token_cuts(self, pairs, tokens, self.chunks))
        result = self._run(program, step, optimizer)
        if result.input_grads:
            backward_inputs([x for x, _ in pairs], result.input_grads, self.chunks)
        if losses is not None and result.own_losses:  # this rank computed the loss
            losses.clear()
            losses.extend(result.own_losses[m] for m in sorted(result.own_losses))
        out = self._losses(result, len(pairs))
        if self.auto is not None:  # the first step's costs synthesised for (and agreed)
            self.auto.after_step()
        return out

    def _seed(self) -> int:
        """The step's seed: drawn here; under tp, tp rank 0's (see `agree_on_seed`)."""
        seed = _step_seed()
        if self._tp_plan is not None and self.mesh is not None and self.world:
            transport = self._executor.transport
            assert isinstance(transport, ProcessTransport)
            try:  # a transport that failed earlier says so here, as every later call must
                seed = tensor_parallel.agree_on_seed(seed, self.mesh, transport.wait_work)
            except (PipelineAborted, PeerFailure) as exc:
                raise PipelineError(str(exc)) from None
        return seed

    def _agree_on_overflow(self, scaler: Any) -> None:
        """The program's OVERFLOW: this rank's scaler sees an overflow if any rank had one."""
        assert self.world is not None
        try:
            agree_on_overflow(scaler, list(self.parameters()), self.devices[self.world[0]],
                              self.group)
        except RuntimeError as exc:
            raise PipelineError(f"rank {self.world[0]}: could not agree on gradient "
                                f"overflow with the other ranks: {exc}") from exc

    def _losses(self, result: StepResult, num_batches: int) -> list[torch.Tensor]:
        """Each batch's loss (the global batch's under dp), on every rank."""
        m = self.chunks
        losses = None
        if result.losses:
            losses = torch.stack([torch.stack([result.losses[k]
                                               for k in range(b * m, (b + 1) * m)]).sum()
                                  for b in range(num_batches)])
        if losses is not None and self._replicas is not None:
            losses = self._replicas.mean(losses)  # the global batch's loss
        shared = self._share(losses, (num_batches,))
        assert shared is not None
        return list(shared.unbind())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients of the whole model by their total norm and return that norm, as
        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on the plain model: over
        every stage (all ranks: every rank calls it), each tied weight once; `inf` too. With a
        GradScaler, call `scaler.unscale_(optimizer)` first."""
        try:
            return clip_grad_norm(self.parameters(), max_norm, norm_type,
                                  error_if_nonfinite=error_if_nonfinite,
                                  exchange=self._executor.exchange)
        except (PipelineAborted, PeerFailure) as exc:
            raise PipelineError(str(exc)) from None

    def close(self) -> None:
        """Stop the rank worker threads (also done when the Pipe is garbage-collected or the
        interpreter exits), and take deferred BatchNorm's hooks off the model's layers. A
        closed Pipe cannot run steps. A weight tied across stages whose owner is held here is
        tied again in the model (`head.weight is wte.weight`)."""
        self._executor.close()
        if self._ft is not None:
            self._ft.close()
        self._tie_link.retie()
        if self._batch_norm is not None:
            self._batch_norm.remove()

    def train(self, mode: bool = True) -> Pipe:
        """As `nn.Module.train`; a model split from its graph runs its train or eval graph."""
        super().train(mode)
        for part in self.partitions:
            part.train(mode)
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """As `nn.Module`'s, with each weight tied across stages once (its owner's)."""
        link = self.__dict__.get("_tie_link")
        copies = link.copy_params() if link is not None else set()
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in copies:
                yield name, p

    # -- inspection -------------------------------------------------------------------------------
    @property
    def _timeline(self) -> Timeline | None:
        """The last step's measured timeline, None before any step."""
        return None if self._timeline_of is None else self._timeline_of()

    def last_timeline(self) -> Timeline:
        """The measured timeline of the last step (seconds), in the simulator's format."""
        if self._timeline is None:
            raise RuntimeError("no step has run yet: call pipe.step(...) or pipe(x) first")
        return self._timeline

    def memory_stats(self) -> list[dict[str, int]]:
        """Per rank, for the last step: the most micro-batches stashed at once, the most
        bytes stashed (stage inputs, plus what autograd saved if `track_memory=True`), the most
        activation bytes held (the stash plus stage outputs not yet released after their
        SEND), and the output bytes released."""
        return [dict(s) for s in self._stats]

    def data_parallel_stats(self) -> dict[str, float]:
        """Pipeline x data parallelism, for the last step: seconds the gradient all-reduces
        over dp ran (`allreduce_s`), seconds the step waited for them after its last action
        (`exposed_s`), and the share of the first the pipeline hid (`hidden_share`)."""
        return dict(self._replicas.sync.stats) if self._replicas is not None else {}

    def extra_repr(self) -> str:
        return (f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, schedule={self._probe.name!r}, "
                f"checkpoint={self.checkpoint!r}")


def _step_seed() -> int:
    # Drawn from torch's global generator: torch.manual_seed(k) makes every step reproducible.
    return int(torch.randint(0, 2**62, (1,)).item())
