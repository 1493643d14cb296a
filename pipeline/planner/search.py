"""The search: schedules x checkpoint modes x dp x pp x micro-batch counts, each split under the
memory limit and simulated, in order of a lower bound that prunes what cannot win.

For every candidate, the layers are split by the exact min-max partition of their profiled
time (forward, backward, and the replay when recomputing); if that split exceeds a rank's
budget, the exact min-max split among those whose every stage fits (a rank's budget shared
evenly by its stages, when it holds several) is taken instead. Candidates are then visited in
increasing order of a lower bound on their step (a rank's total work, or one micro-batch's
path through every stage): once the bound reaches the fastest simulated step, no later
candidate can be faster, and the rest are pruned without simulating them. Ranks on CPU slow
each other (shared cores, caches, memory bandwidth): with a measured contention factor above
1, each candidate is simulated a second time with every rank's work slowed by that factor for
the share of it that overlapped another rank's in the first simulation (the bounds, computed
at full speed, stay lower bounds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import schedules
from pipeline.planner.costs import LayerCosts, ModelProfile
from pipeline.planner.link import Link
from pipeline.planner.memory import checkpointed, format_bytes, rank_peaks, stash_profile
from pipeline.planner.space import Candidate, Configuration, Space
from pipeline.splitting.partition import BalanceError, bounds, min_max_split, partition
from schedules import SYNC_OPS, Costs, Op, Schedule, Syncs, Timeline

__all__ = ["predict", "search"]

_SLACK = 1 + 1e-12  # budgets are compared with this much rounding allowed


@dataclass
class _Work:
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


class _Search:
    def __init__(self, profile: ModelProfile, link: Link, ranks: int, limits: Sequence[float],
                 optimizer: tuple[float, int], contention: float = 1.0) -> None:
        self.profile, self.link, self.ranks = profile, link, ranks
        self.contention = contention
        self.limits, self.optimizer = list(limits), optimizer
        self.n = profile.num_layers
        self._schedules: dict[tuple[Any, ...], Schedule] = {}
        self._splits: dict[tuple[Any, ...], list[int]] = {}
        self._stashes: dict[tuple[Any, ...], dict[int, tuple[tuple[int, int], ...]]] = {}

    # -- per candidate ---------------------------------------------------------------------------
    def schedule(self, w: _Work) -> Schedule:
        c = w.config
        key = (c.schedule, c.options, c.pp, c.chunks)
        if key not in self._schedules:
            self._schedules[key] = schedules.get_schedule(c.schedule, c.pp, c.chunks,
                                                          **dict(c.options))
        return self._schedules[key]

    @staticmethod
    def recompute_share(w: _Work) -> float:
        return sum(checkpointed(w.config.checkpoint, w.config.chunks)) / w.config.chunks

    def layer_times(self, w: _Work, split: bool) -> list[float]:
        c, rc = w.costs, self.recompute_share(w)
        back = ([i + wt for i, wt in zip(c.backward_input, c.backward_weight, strict=True)]
                if split else list(c.backward))
        return [f * (1 + rc) + b for f, b in zip(c.forward, back, strict=True)]

    def static(self, w: _Work, start: int, stop: int, versioned: bool) -> float:
        total, trainable, tensors = self.profile.static_bytes(start, stop)
        per_byte, per_tensor = self.optimizer
        extra = trainable * (1 + per_byte + (1 if w.config.dp > 1 else 0)) + tensors * per_tensor
        return total + extra + (2 * total if versioned else 0)

    def evaluate(self, w: _Work, balance: Sequence[int] | None = None) -> bool:
        """Split `w` under its budget (or take `balance` as given); False (with `w.reason`)
        if nothing fits."""
        sched = w.schedule = self.schedule(w)
        k, per_rank = sched.num_stages, sched.num_stages // sched.num_ranks
        ops = {a.op for row in sched.actions for a in row}
        split, versioned = Op.I in ops, Op.U in ops
        rec = checkpointed(w.config.checkpoint, w.config.chunks)
        c = w.config
        which = (c.schedule, c.options, c.pp, c.chunks, c.checkpoint)
        if which not in self._stashes:
            self._stashes[which] = stash_profile(sched, rec)
        stash = self._stashes[which]
        times = self.layer_times(w, split)
        saved = [0.0]
        for s in w.costs.saved_bytes:
            saved.append(saved[-1] + s)
        inputs = w.costs.input_bytes
        limit = [min(self.limits[d * c.pp + sched.rank_of(s)] for d in range(c.dp)) / per_rank
                 for s in range(k)]

        def stage_mem(s: int, j: int, i: int) -> float:
            graph = saved[i] - saved[j]
            return self.static(w, j, i, versioned) + max(
                (a * inputs[j] + b * graph for a, b in stash.get(s, ((0, 0),))), default=0.0)

        def peaks(balance: list[int]) -> tuple[float, ...]:
            edges = bounds(balance)
            ins = [inputs[edges[s]] for s in range(k)]
            graphs = [saved[edges[s + 1]] - saved[edges[s]] for s in range(k)]
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
        got = peaks(balance)
        over = [r for r in range(w.config.pp) if got[r] > limit[sched.stages_of(r)[0]] * per_rank
                * _SLACK]
        w.reason = "the fastest split fits"
        if over:
            try:
                balance = partition(times, k, fits=lambda s, j, i: stage_mem(s, j, i)
                                    <= limit[s] * _SLACK)
            except BalanceError:
                r = over[0]
                budget = limit[sched.stages_of(r)[0]] * per_rank
                w.reason = (f"rank {r} needs {format_bytes(got[r])} with the fastest split "
                            f"{balance}; no split fits {format_bytes(budget)}")
                w.balance, w.peaks = balance, got
                return False
            got = peaks(balance)
            w.reason = "split to fit the budget"
        w.balance, w.peaks = balance, got
        w.bound = self.bound(w, balance)
        return True

    def stage_costs(self, w: _Work, balance: Sequence[int]) -> Costs:
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
        reduce = [self.link.allreduce(self.profile.static_bytes(edges[s], edges[s + 1])[1], dp)
                  if dp > 1 else 0.0 for s in range(len(balance))]
        return Costs(forward=out["forward"], backward=out["backward"],
                     backward_input=out["backward_input"],
                     backward_weight=out["backward_weight"], comm=self.link.time(boundary),
                     reduce_grad=reduce)

    def bound(self, w: _Work, balance: Sequence[int]) -> float:
        """A lower bound on the step: no rank finishes before its own work is done, and no
        step before one micro-batch has gone forward and back through every stage."""
        assert w.schedule is not None
        costs = self.stage_costs(w, balance)
        split = w.extra["split"]
        work = [costs.of(Op.F, s) + (costs.of(Op.I, s) + costs.of(Op.W, s) if split
                                     else costs.of(Op.B, s)) for s in range(len(balance))]
        busy = max(w.config.chunks * sum(work[s] for s in w.schedule.stages_of(r))
                   for r in range(w.config.pp))
        chain = sum(costs.of(Op.F, s) + costs.of(Op.I if split else Op.B, s)
                    for s in range(len(balance)))
        # Beside replicas every rank's work is slowed by the whole contention factor.
        return max(busy, chain) * (self.contention if w.config.dp > 1 else 1.0)

    def simulate(self, w: _Work, best: float = math.inf
                 ) -> tuple[float, float, Timeline] | None:
        """(step seconds, exposed all-reduce seconds, timeline) of an evaluated candidate;
        None if, simulated at full speed, it already takes `best` or longer (contention only
        slows it further)."""
        assert w.schedule is not None and w.balance is not None
        costs = self.stage_costs(w, w.balance)
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
        finish = timeline.makespan
        if w.config.dp == 1:
            return finish, 0.0, timeline
        # What the reductions add: the step's end past the end of the pipeline's own work.
        span = max(e.end for e in timeline.events if e.action.op not in SYNC_OPS)
        return finish, finish - span, timeline

    def contended(self, w: _Work, costs: Costs, timeline: Timeline
                  ) -> tuple[Costs, list[float]]:
        """`costs` with each rank's compute slowed by the contention factor for the share of
        its work that overlaps another rank's (all of it when replicas run beside it), and
        each rank's slowdown."""
        assert w.schedule is not None
        overlaps = _overlaps(timeline, w.config.pp) if w.config.dp == 1 else []
        slow: dict[int, float] = {}
        factors = []
        for r in range(w.config.pp):
            if w.config.dp > 1:
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

    def least_budget(self, w: _Work) -> float:
        """The smallest budget per rank under which this candidate gets a split."""
        if w.peaks is None:
            return math.inf
        per_rank = w.extra["per_rank"]
        _, worst = min_max_split(self.n, len(w.balance or ()), w.extra["stage_mem"])
        return float(min(max(w.peaks), per_rank * worst))


def predict(profile: ModelProfile, link: Link, *, schedule: str, chunks: int, checkpoint: str,
            balance: Sequence[int] | None = None, options: Sequence[tuple[str, int]] = (),
            dp: int = 1, pp: int | None = None, optimizer: tuple[float, int] = (2.0, 4),
            contention: float = 1.0) -> Candidate:
    """The prediction for one configuration (`balance` None: the min-max split of time), as a
    `Candidate` with status "fits" whatever the budget."""
    if pp is None:
        if balance is None:
            raise ValueError("predict needs pp (pipeline ranks) or a balance")
        gen = schedules.info(schedule)
        pp = len(balance) // dict(options).get(gen.stages_option or "", gen.stages_per_rank)
    rows = -(-(profile.batch_rows // dp) // chunks)
    s = _Search(profile, link, dp * pp, [math.inf] * (dp * pp), optimizer, contention)
    w = _Work(Configuration(schedule, tuple(options), dp, pp, chunks, rows, checkpoint),
              profile.at(rows), 0.0)
    s.evaluate(w, balance)
    got = s.simulate(w)
    assert got is not None
    step, exposed, timeline = got
    return _row(w, "fits", "", step, exposed, timeline)


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


def search(profile: ModelProfile, link: Link, *, ranks: int, limits: Sequence[float],
           optimizer: tuple[float, int], space: Space,
           contention: float = 1.0) -> tuple[list[Candidate], float, str]:
    """Every candidate of `space` with its verdict, the chosen one first; and, when none fits,
    the smallest budget per rank under which one would (else 0) and that candidate."""
    s = _Search(profile, link, ranks, limits, optimizer, contention)
    rows_total = profile.batch_rows
    table: list[Candidate] = []
    todo: list[_Work] = []
    for dp in space.dps:
        pp = ranks // dp
        if ranks % dp or rows_total % dp:
            continue
        rows = rows_total // dp
        for m in space.chunk_counts(rows, pp):
            mb = -(-rows // m)
            if mb not in profile.by_rows:
                for name, opts in space.schedules:
                    for ckpt in space.checkpoints:
                        table.append(Candidate(name, opts, dp, pp, m, mb, ckpt, "impossible",
                                               f"not profiled at {mb} rows per micro-batch"))
                continue
            costs = profile.at(mb)
            for name, opts in space.schedules:
                gen = schedules.info(name)
                v = dict(opts).get(gen.stages_option or "", gen.stages_per_rank)
                if v * pp > profile.num_layers:
                    for ckpt in space.checkpoints:
                        table.append(Candidate(name, opts, dp, pp, m, mb, ckpt, "impossible",
                                               f"needs {v * pp} stages, the model has "
                                               f"{profile.num_layers} layers"))
                    continue
                for ckpt in space.checkpoints:
                    if ckpt == "except_last" and m == 1 and "never" in space.checkpoints:
                        continue  # one micro-batch: except_last recomputes nothing
                    w = _Work(Configuration(name, opts, dp, pp, m, mb, ckpt), costs, 0.0)
                    # Before splitting: the average rank's work, one micro-batch's path (with
                    # the cheaper backward of the split and unsplit kinds, so it bounds both).
                    rc = s.recompute_share(w)
                    c = costs
                    work = sum(f * (1 + rc) + min(b, i + wt) for f, b, i, wt in zip(
                        c.forward, c.backward, c.backward_input, c.backward_weight, strict=True))
                    chain = sum(f * (1 + rc) + min(b, i) for f, b, i in zip(
                        c.forward, c.backward, c.backward_input, strict=True))
                    w.bound0 = max(m * work / pp, chain) * (s.contention if dp > 1 else 1.0)
                    todo.append(w)
    todo.sort(key=lambda w: w.bound0)
    best = math.inf
    evaluated: list[_Work] = []
    results: list[tuple[_Work, float, float, Timeline]] = []
    for w in todo:
        if w.bound0 >= best:
            table.append(Candidate(**vars(w.config), status="pruned",
                                   reason=f"even a perfect split takes >= "
                                          f"{w.bound0 * 1e3:.2f} ms", lower_bound=w.bound0))
            continue
        if not s.evaluate(w):
            evaluated.append(w)
            table.append(_row(w, "over budget"))
            continue
        if w.bound >= best:
            table.append(_row(w, "pruned", f"lower bound {w.bound * 1e3:.2f} ms"))
            continue
        got = s.simulate(w, best)
        if got is None:
            table.append(_row(w, "pruned", f"at full speed already {w.bound * 1e3:.2f} ms"))
            continue
        step, exposed, timeline = got
        best = min(best, step)
        results.append((w, step, exposed, timeline))
    for w, step, exposed, timeline in results:
        table.append(_row(w, "fits", w.reason, step, exposed, timeline))
    least, where = 0.0, ""
    if not results:
        least = math.inf
        for w in evaluated:
            need = s.least_budget(w)
            if need < least:
                cfg = w.config
                least, where = need, (f"{cfg.label}, dp {cfg.dp} x pp {cfg.pp}, chunks "
                                      f"{cfg.chunks}, checkpoint {cfg.checkpoint!r}")
    table.sort(key=_order)
    if results:
        table[0] = _replace_status(table[0], "chosen")
    return table, least, where


def _row(w: _Work, status: str, reason: str | None = None, step: float | None = None,
         exposed: float = 0.0, timeline: Timeline | None = None) -> Candidate:
    return Candidate(**vars(w.config), status=status,
                     reason=w.reason if reason is None else reason,
                     balance=tuple(w.balance) if w.balance else None, step_time=step,
                     lower_bound=w.bound or None, peak_bytes=w.peaks, activation_bytes=w.acts,
                     allreduce_time=exposed, timeline=timeline)


_RANK = {"chosen": 0, "fits": 0, "pruned": 1, "over budget": 2, "impossible": 3}


def _order(c: Candidate) -> tuple[Any, ...]:
    return (_RANK[c.status], c.step_time if c.step_time is not None else math.inf,
            max(c.peak_bytes) if c.peak_bytes else math.inf, c.lower_bound or math.inf)


def _replace_status(c: Candidate, status: str) -> Candidate:
    return replace(c, status=status)
