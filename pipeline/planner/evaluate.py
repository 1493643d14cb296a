"""One candidate evaluated: its split under the memory limit, its costs, bound and simulation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import schedules
from pipeline.errors import PipeConfigError
from pipeline.planner.costs import LayerCosts, ModelProfile
from pipeline.planner.link import Link
from pipeline.planner.memory import checkpointed, format_bytes, rank_peaks, stash_profile
from pipeline.planner.space import Configuration
from pipeline.planner.tensor import TensorSharding, shard_profile
from pipeline.planner.time_model import TimeModel
from pipeline.splitting.partition import (
    BalanceError,
    bounds,
    min_max_split,
    partition,
    partition_by_reach,
)
from schedules import SYNC_OPS, Costs, Op, Schedule, Syncs, Timeline
from schedules.auto import synthesize

__all__ = ["AUTO_SYNTHESIS", "Evaluator", "Work", "beside"]

_SLACK = 1 + 1e-12  # budgets are compared with this much rounding allowed
# The most ranks x micro-batches for which "auto" is synthesised per split: its search takes
# about 0.1 s of CPU at 8 x 16 and grows faster than p x m (2.4 s at 16 x 64), and a plan of
# 1024 ranks evaluates thousands of splits; beyond it "auto" is predicted in its unit-cost order.
AUTO_SYNTHESIS = 128


@dataclass
class Work:
    """A configuration being evaluated: its schedule, per-layer costs and memory model."""

    config: Configuration
    costs: LayerCosts
    bound0: float
    schedule: Schedule | None = None
    balance: list[int] | None = None
    peaks: tuple[float, ...] | None = None
    acts: tuple[float, ...] | None = None
    reason: str = ""
    bound: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Evaluator:
    """Evaluates candidates of one search: their profiles per tp size, links, schedules,
    splits and stash walks, cached across candidates that share them."""

    def __init__(self, profile: ModelProfile, link: Link, ranks: int, limits: Sequence[float],
                 optimizer: tuple[float, int], contention: float = 1.0,
                 sharding: TensorSharding | None = None, host_link: Link | None = None,
                 ranks_per_host: int | None = None, time_model: TimeModel | None = None
                 ) -> None:
        self.profile, self.link, self.ranks = profile, link, ranks
        # A fitted time model brings its own contention (fitted with its other terms).
        self.time_model = time_model
        self.contention = contention if time_model is None else time_model.contention
        self.limits, self.optimizer = list(limits), optimizer
        self.n = profile.num_layers
        self.sharding = sharding
        self.host_link = link if host_link is None else host_link
        self.per_host = ranks if ranks_per_host is None else ranks_per_host
        self._profiles: dict[int, ModelProfile] = {1: profile}
        self._schedules: dict[tuple[Any, ...], Schedule] = {}
        self._splits: dict[tuple[Any, ...], list[int]] = {}
        self._stashes: dict[tuple[Any, ...], dict[int, tuple[tuple[int, int], ...]]] = {}

    def profile_of(self, tp: int) -> ModelProfile:
        """The profile each of `tp` tensor-parallel ranks sees."""
        if tp not in self._profiles:
            if self.sharding is None:
                raise PipeConfigError(f"tp {tp} needs to know what tensor parallelism splits: "
                                      f"pass tp_plan= (or a TensorSharding)")
            self._profiles[tp] = shard_profile(self.profile, self.sharding, tp, self.host_link)
        return self._profiles[tp]

    def p2p_link(self, c: Configuration) -> Link:
        """The link a pipeline's messages take: within a host if it holds the whole pipeline."""
        return self.host_link if c.tp * c.pp <= self.per_host else self.link

    def dp_link(self) -> Link:
        """The link of the dp all-reduce: between hosts when the ranks span several."""
        return self.host_link if self.ranks <= self.per_host else self.link

    # -- per candidate ---------------------------------------------------------------------------
    def schedule(self, w: Work) -> Schedule:
        c = w.config
        key = (c.schedule, c.options, c.pp, c.chunks)
        if key not in self._schedules:
            self._schedules[key] = schedules.get_schedule(c.schedule, c.pp, c.chunks,
                                                          **dict(c.options))
        return self._schedules[key]

    @staticmethod
    def recompute_share(w: Work) -> float:
        return sum(checkpointed(w.config.checkpoint, w.config.chunks)) / w.config.chunks

    def layer_times(self, w: Work, split: bool) -> list[float]:
        c, rc = w.costs, self.recompute_share(w)
        back = ([i + wt for i, wt in zip(c.backward_input, c.backward_weight, strict=True)]
                if split else list(c.backward))
        return [f * (1 + rc) + b for f, b in zip(c.forward, back, strict=True)]

    def static(self, w: Work, start: int, stop: int, versioned: bool) -> float:
        total, trainable, tensors = self.profile_of(w.config.tp).static_bytes(start, stop)
        per_byte, per_tensor = self.optimizer
        extra = trainable * (1 + per_byte + (1 if w.config.dp > 1 else 0)) + tensors * per_tensor
        return total + extra + (2 * total if versioned else 0)

    def stash_of(self, w: Work, rec: Sequence[bool]) -> dict[int, tuple[tuple[int, int], ...]]:
        """The (inputs, saved graphs) a stage can peak at, per stage, for `w`'s schedule."""
        c = w.config
        which = (c.schedule, c.options, c.pp, c.chunks, c.checkpoint)
        if which not in self._stashes:
            assert w.schedule is not None
            self._stashes[which] = stash_profile(w.schedule, rec)
        return self._stashes[which]

    def evaluate(self, w: Work, balance: Sequence[int] | None = None,
                 best: float = math.inf, thorough: bool = False) -> bool:
        """Split `w` under its budget (or take `balance` as given); False (with `w.reason`)
        if nothing fits. Unless `thorough`, two shortcuts skip walking the schedule: a
        candidate that no split could make faster than `best` is left unsplit (`w.balance`
        None, `w.bound` why), and one whose ranks cannot hold the parameters and optimizer
        state at all is over budget without its peaks (`w.peaks` None)."""
        sched = w.schedule = self.schedule(w)
        k, per_rank = sched.num_stages, sched.num_stages // sched.num_ranks
        ops = {a.op for row in sched.actions for a in row}
        split, versioned = Op.I in ops, Op.U in ops
        rec = checkpointed(w.config.checkpoint, w.config.chunks)
        c = w.config
        times = self.layer_times(w, split)
        saved = [0.0]
        for s in w.costs.saved_bytes:
            saved.append(saved[-1] + s)
        inputs = w.costs.input_bytes
        # Ranks are numbered (dp, pp, tp), tp innermost; a stage gets its tightest rank's budget.
        limit = [min(self.limits[(d * c.pp + sched.rank_of(s)) * c.tp + t] for d in range(c.dp)
                     for t in range(c.tp)) / per_rank for s in range(k)]

        def stage_mem(s: int, j: int, i: int) -> float:
            graph = saved[i] - saved[j]
            return self.static(w, j, i, versioned) + max(
                (a * inputs[j] + b * graph for a, b in self.stash_of(w, rec).get(s, ((0, 0),))),
                default=0.0)

        def peaks(balance: list[int]) -> tuple[float, ...]:
            edges = bounds(balance)
            ins = [inputs[edges[s]] for s in range(k)]
            graphs = [saved[edges[s + 1]] - saved[edges[s]] for s in range(k)]
            if per_rank == 1:  # a rank's peak is its one stage's (the walk's, as tested)
                stash = self.stash_of(w, rec)
                w.acts = tuple(max((a * ins[q] + b * graphs[q] for a, b in stash.get(q, ())),
                                   default=0.0) for q in (sched.stages_of(r)[0]
                                                          for r in range(sched.num_ranks)))
            else:
                w.acts = rank_peaks(sched, rec, ins, graphs)
            return tuple(w.acts[r] + sum(self.static(w, edges[s], edges[s + 1], versioned)
                                         for s in sched.stages_of(r)) for r in range(w.config.pp))

        w.extra.update(stage_mem=stage_mem, per_rank=per_rank, split=split)
        if balance is not None:
            w.balance, w.peaks = list(balance), peaks(list(balance))
            w.bound = self.bound(w, balance)
            return True
        key = (tuple(times), k)
        if key not in self._splits:
            self._splits[key] = partition(times, k)
        balance = self._splits[key]
        if not thorough:
            # No split has a stage faster than the fastest split's slowest: a bound for all.
            fastest = max(sum(times[j:i]) for j, i in itertools.pairwise(bounds(balance)))
            lower = max(c.chunks * fastest, self.bound(w, balance, chain_only=True))
            if lower >= best:
                w.bound, w.peaks, w.acts = lower, None, None
                return True
            whole, room = self.static(w, 0, self.n, versioned), sum(limit)
            if whole > room * _SLACK:
                w.reason = (f"parameters, gradients and optimizer state take "
                            f"{format_bytes(whole)}, more than the {k} stages' budgets hold "
                            f"together ({format_bytes(room)})")
                w.balance, w.peaks = balance, None
                return False
        got = peaks(balance)
        over = [r for r in range(w.config.pp) if got[r] > limit[sched.stages_of(r)[0]] * per_rank
                * _SLACK]
        w.reason = "the fastest split fits"
        if over:
            r = over[0]
            w.reason = (f"rank {r} needs {format_bytes(got[r])} with the fastest split "
                        f"{balance}; no split fits "
                        f"{format_bytes(limit[sched.stages_of(r)[0]] * per_rank)}")
            if not self.could_fit(w, limit, self.stash_of(w, rec), saved, versioned):
                w.balance, w.peaks = balance, got
                return False
            try:
                balance = partition_by_reach(times, k, lambda s, j, i: stage_mem(s, j, i)
                                        <= limit[s] * _SLACK)
            except BalanceError:
                w.balance, w.peaks = balance, got
                return False
            got = peaks(balance)
            w.reason = "split to fit the budget"
        w.balance, w.peaks = balance, got
        w.bound = self.bound(w, balance)
        return True

    def could_fit(self, w: Work, limit: Sequence[float], stash: dict[int, tuple[tuple[int, int],
                  ...]], saved: Sequence[float], versioned: bool) -> bool:
        """A necessary condition for some split to fit, in O(stages): the stages' budgets hold
        every parameter once (each stage holds at least its own), and, a stage holding b
        micro-batches' saved tensors at some moment needing b bytes per saved byte, the
        budgets divided by b hold one micro-batch's saved tensors of every layer (stage s
        holds g_s of them with limit_s >= static_s + b_s g_s). It rejects most candidates that
        fit nowhere without running the exact memory-limited split."""
        k = len(limit)
        whole = self.static(w, 0, self.n, versioned)
        if sum(limit) * _SLACK < whole:
            return False
        most = [max((b for _, b in stash.get(s, ((0, 0),))), default=0) for s in range(k)]
        if min(most) == 0:
            return True
        room = sum(limit[s] / most[s] for s in range(k))
        return room * _SLACK >= (saved[-1] - saved[0]) + whole / max(most)

    def stage_costs(self, w: Work, balance: Sequence[int]) -> Costs:
        c, rc = w.costs, self.recompute_share(w)
        out: dict[str, list[float]] = {"forward": [], "backward": [], "backward_input": [],
                                       "backward_weight": []}
        start = 0
        for size in balance:
            part = range(start, start + size)
            f = sum(c.forward[i] for i in part)
            out["forward"].append(f)
            out["backward"].append(sum(c.backward[i] for i in part) + rc * f)
            out["backward_input"].append(sum(c.backward_input[i] for i in part) + rc * f)
            out["backward_weight"].append(sum(c.backward_weight[i] for i in part))
            start += size
        edges = bounds(balance)
        boundary = max((c.input_bytes[i] for i in edges[1:-1]), default=0.0)
        dp = w.config.dp  # under dp, each stage's gradient all-reduce (its REDUCE_GRAD)
        profile = self.profile_of(w.config.tp)
        reduce = [self.dp_link().allreduce(profile.static_bytes(edges[s], edges[s + 1])[1], dp)
                  if dp > 1 else 0.0 for s in range(len(balance))]
        costs = Costs(forward=out["forward"], backward=out["backward"],
                      backward_input=out["backward_input"],
                      backward_weight=out["backward_weight"],
                      comm=self.p2p_link(w.config).time(boundary), reduce_grad=reduce)
        return costs if self.time_model is None else self.time_model.costs(costs, w.config.rows)

    def bound(self, w: Work, balance: Sequence[int], chain_only: bool = False) -> float:
        """A lower bound on the step: no rank finishes before its own work is done, and no
        step before one micro-batch has gone forward and back through every stage (that
        chain alone, the same for every split, with `chain_only`)."""
        assert w.schedule is not None
        costs = self.stage_costs(w, balance)
        split = w.extra["split"]
        work = [costs.of(Op.F, s) + (costs.of(Op.I, s) + costs.of(Op.W, s) if split
                                     else costs.of(Op.B, s)) for s in range(len(balance))]
        busy = 0.0 if chain_only else max(
            w.config.chunks * sum(work[s] for s in w.schedule.stages_of(r))
            for r in range(w.config.pp))
        chain = sum(costs.of(Op.F, s) + costs.of(Op.I if split else Op.B, s)
                    for s in range(len(balance)))
        edges = 0.0 if chain_only else self.edges(w, costs, work)
        # Beside replicas or tp peers every rank's work is slowed by the whole contention.
        return max(busy, chain, edges) * (self.contention if beside(w.config) else 1.0)

    @staticmethod
    def edges(w: Work, costs: Costs, work: Sequence[float]) -> float:
        """With one stage per rank, a bound that counts the pipeline's fill and drain: a rank
        starts once the first micro-batch has come forward through the stages before it, and
        when its last action is a whole backward, the step ends only after that micro-batch's
        backward has gone back through them (each hop paying the link's latency)."""
        sched = w.schedule
        assert sched is not None
        if sched.num_stages != sched.num_ranks:
            return 0.0
        compute = (Op.F, Op.B, Op.I, Op.W)
        head = tail = bound = 0.0
        for s in range(sched.num_stages):
            row = sched.actions[sched.rank_of(s)]
            last = next((a.op for a in reversed(row) if a.op in compute), None)
            bound = max(bound, head + w.config.chunks * work[s]
                        + (tail if last is Op.B else 0.0))
            head += costs.of(Op.F, s) + costs.comm
            tail += costs.of(Op.B, s) + costs.comm
        return bound

    def simulate(self, w: Work, best: float = math.inf
                 ) -> tuple[float, float, Timeline] | None:
        """(step seconds, exposed all-reduce seconds, timeline) of an evaluated candidate;
        None if, simulated at full speed, it already takes `best` or longer (contention only
        slows it further)."""
        assert w.schedule is not None and w.balance is not None
        costs = self.stage_costs(w, w.balance)
        if (schedules.info(w.config.schedule).synthesised
                and w.config.pp * w.config.chunks <= AUTO_SYNTHESIS):
            # Synthesised for this split's costs, within the activations the memory check
            # counted (the unit-cost order's peaks): a Pipe with schedule="auto" synthesises
            # again for the costs it measures. The search lists none larger.
            limit = list(schedules.peak_activations(w.schedule.actions))
            w.schedule = synthesize(w.config.pp, w.config.chunks, costs, limit)
        # The step's program: under dp, each stage's REDUCE_GRAD after its last gradient
        # action and the rank's AWAIT_GRAD, timed by the simulator (schedules.program).
        step = (schedules.program(w.schedule, Syncs(dp=True)) if w.config.dp > 1
                else w.schedule)
        timeline = schedules.simulate(step, costs)
        if self.contention > 1:
            slowed, factors = self.contended(w, costs, timeline)
            # Each rank's work, slowed, is a bound on the slowed step too.
            busy = max(timeline.busy(r) * factors[r] for r in range(w.config.pp))
            if max(timeline.makespan, busy) >= best:
                w.bound = max(w.bound, timeline.makespan, busy)
                return None
            timeline = schedules.simulate(step, slowed)
        # The step's own time outside its actions (fitted), which the simulator does not have.
        finish = timeline.makespan + (self.time_model.step if self.time_model else 0.0)
        if w.config.dp == 1:
            return finish, 0.0, timeline
        # What the reductions add: the step's end past the end of the pipeline's own work.
        span = max(e.end for e in timeline.events if e.action.op not in SYNC_OPS)
        return finish, finish - span, timeline

    def contended(self, w: Work, costs: Costs, timeline: Timeline
                  ) -> tuple[Costs, list[float]]:
        """`costs` with each rank's compute slowed by the contention factor for the share of
        its work that overlaps another rank's (all of it when replicas run beside it), and
        each rank's slowdown."""
        assert w.schedule is not None
        overlaps = _overlaps(timeline, w.config.pp) if not beside(w.config) else []
        slow: dict[int, float] = {}
        factors = []
        for r in range(w.config.pp):
            if beside(w.config):
                share = 1.0
            else:
                mine, shared = overlaps[r]
                share = shared / mine if mine > 0 else 0.0
            factors.append(1 + (self.contention - 1) * share)
            for s in w.schedule.stages_of(r):
                slow[s] = factors[-1]
        k = len(slow)

        def scaled(value: float | Sequence[float]) -> tuple[float, ...]:
            values = [value] * k if isinstance(value, int | float) else list(value)
            return tuple(v * slow[s] for s, v in enumerate(values))

        return Costs(forward=scaled(costs.forward), backward=scaled(costs.backward),
                     backward_input=scaled(costs.backward_input),
                     backward_weight=scaled(costs.backward_weight), comm=costs.comm,
                     reduce_grad=costs.reduce_grad), factors

    def least_budget(self, w: Work) -> float:
        """The smallest budget per rank under which this candidate gets a split."""
        if w.peaks is None:
            return math.inf
        per_rank = w.extra["per_rank"]
        _, worst = min_max_split(self.n, len(w.balance or ()), w.extra["stage_mem"])
        return float(min(max(w.peaks), per_rank * worst))


def beside(c: Configuration) -> bool:
    """Whether every rank computes beside others all the time (dp replicas, tp peers)."""
    return c.dp > 1 or c.tp > 1


def _overlaps(timeline: Timeline, num_ranks: int) -> list[tuple[float, float]]:
    """Per rank, (compute time, the part of it while another rank also computes): one sweep
    over every compute action's start and end."""
    points = sorted((t, d, e.rank) for e in timeline.events if e.action.is_compute
                    and e.end > e.start for t, d in ((e.start, 1), (e.end, -1)))
    active = [0] * num_ranks
    busy = [0.0] * num_ranks
    shared = [0.0] * num_ranks
    running, prev = 0, 0.0
    for t, d, r in points:  # ends sort before starts at the same time (-1 < 1)
        if running and t > prev:
            for q in range(num_ranks):
                if active[q]:
                    busy[q] += t - prev
                    if running >= 2:
                        shared[q] += t - prev
        was = active[r]
        active[r] += d
        running += (active[r] > 0) - (was > 0)
        prev = t
    return list(zip(busy, shared, strict=True))
