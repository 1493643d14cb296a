"""The search: schedules x checkpoint modes x dp x pp x tp x micro-batch counts, each split under
the memory limit and simulated, in order of a lower bound that prunes what cannot win.

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
at full speed, stay lower bounds). Predicted steps within `ties.NEAR` of the fastest are near
ties, and the simplest of them is chosen (`pipeline.planner.ties`): a candidate is pruned only
once its bound is beyond the fastest step by that margin. Given the last choice (`last`, from
`pipeline.planner.remembered`), that candidate is split and simulated even when pruned, so the
choice can weigh it re-predicted from this profile (`ties.choose` keeps it within `ties.KEEP`).

Under tensor parallelism each tp size has its own profile, the one its ranks see
(`pipeline.planner.tensor.shard_profile`), and the search runs on it as on any other. Ranks sit
`ranks_per_host` to a host, tp innermost, then pp, then dp (Megatron-LM's order: tp within a
host, pp across hosts, dp outermost): a pipeline's messages take the host link when the whole
pipeline with its tp ranks fits in a host and the link between hosts otherwise; the dp
all-reduce takes the link between hosts when the ranks span several.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import schedules
from pipeline.planner.costs import ModelProfile
from pipeline.planner.evaluate import AUTO_SYNTHESIS, Evaluator, Work, beside
from pipeline.planner.link import Link
from pipeline.planner.progress import SILENT, Progress
from pipeline.planner.space import Candidate, Configuration, Space
from pipeline.planner.tensor import TensorSharding, mesh_shapes
from pipeline.planner.ties import NEAR, choose, identity
from pipeline.planner.time_model import TimeModel
from schedules import Timeline

__all__ = ["predict", "search"]


def predict(profile: ModelProfile, link: Link, *, schedule: str, chunks: int, checkpoint: str,
            balance: Sequence[int] | None = None, options: Sequence[tuple[str, int]] = (),
            dp: int = 1, pp: int | None = None, optimizer: tuple[float, int] = (2.0, 4),
            contention: float = 1.0, tp: int = 1, sharding: TensorSharding | None = None,
            host_link: Link | None = None, ranks_per_host: int | None = None,
            time_model: TimeModel | None = None) -> Candidate:
    """The prediction for one configuration (`balance` None: the min-max split of time), as a
    `Candidate` with status "fits" whatever the budget. With `tp` > 1, `sharding` says what
    tensor parallelism splits; `host_link` (default `link`) carries its collectives and
    `ranks_per_host` (default: every rank on one host) places the ranks; `time_model` (fitted
    from measured steps, `fit_time_model`) prices it as this machine runs, its contention
    replacing `contention`."""
    if pp is None:
        if balance is None:
            raise ValueError("predict needs pp (pipeline ranks) or a balance")
        gen = schedules.info(schedule)
        pp = len(balance) // dict(options).get(gen.stages_option or "", gen.stages_per_rank)
    rows = -(-(profile.batch_rows // dp) // chunks)
    ranks = dp * pp * tp
    s = Evaluator(profile, link, ranks, [math.inf] * ranks, optimizer, contention, sharding,
                host_link, ranks_per_host, time_model)
    w = Work(Configuration(schedule, tuple(options), dp, pp, chunks, rows, checkpoint, tp=tp),
              s.profile_of(tp).at(rows), 0.0)
    s.evaluate(w, balance)
    got = s.simulate(w)
    assert got is not None
    step, exposed, timeline = got
    return _row(w, "fits", "", step, exposed, timeline)


def search(profile: ModelProfile, link: Link, *, ranks: int, limits: Sequence[float],
           optimizer: tuple[float, int], space: Space, contention: float = 1.0,
           sharding: TensorSharding | None = None, host_link: Link | None = None,
           ranks_per_host: int | None = None, time_model: TimeModel | None = None,
           progress: Progress = SILENT, last: Configuration | None = None
           ) -> tuple[list[Candidate], float, str]:
    """Every candidate of `space` with its verdict, the chosen one first; and, when none fits,
    the smallest budget per rank under which one would (else 0) and that candidate. Tensor
    parallel sizes other than 1 (`space.tps`) need `sharding`; see `predict` for the links.
    `last`: the last choice, simulated whatever its bound, and kept when `ties.choose` says."""
    s = Evaluator(profile, link, ranks, limits, optimizer, contention, sharding, host_link,
                ranks_per_host, time_model)
    rows_total = profile.batch_rows
    table: list[Candidate] = []
    todo: list[Work] = []
    for dp, pp, tp in mesh_shapes(ranks, rows_total, space.dps, space.tps):
        rows = rows_total // dp
        for m in space.chunk_counts(rows, pp):
            mb = -(-rows // m)
            if mb not in profile.by_rows:
                for name, opts in space.schedules:
                    for ckpt in space.checkpoints:
                        table.append(Candidate(name, opts, dp, pp, m, mb, ckpt, "impossible",
                                               f"not profiled at {mb} rows per micro-batch",
                                               tp=tp))
                continue
            costs = s.profile_of(tp).at(mb)
            for name, opts in space.schedules:
                gen = schedules.info(name)
                v = dict(opts).get(gen.stages_option or "", gen.stages_per_rank)
                if v * pp > profile.num_layers:
                    for ckpt in space.checkpoints:
                        table.append(Candidate(name, opts, dp, pp, m, mb, ckpt, "impossible",
                                               f"needs {v * pp} stages, the model has "
                                               f"{profile.num_layers} layers", tp=tp))
                    continue
                if gen.synthesised and pp * m > AUTO_SYNTHESIS:
                    continue  # too large to synthesise per split; its unit-cost order is zb-h1
                for ckpt in space.checkpoints:
                    if ckpt == "except_last" and m == 1 and "never" in space.checkpoints:
                        continue  # one micro-batch: except_last recomputes nothing
                    w = Work(Configuration(name, opts, dp, pp, m, mb, ckpt, tp=tp), costs,
                              0.0)
                    # Before splitting: the average rank's work, one micro-batch's path (with
                    # the cheaper backward of the split and unsplit kinds, so it bounds both).
                    rc = s.recompute_share(w)
                    c = costs
                    work = sum(f * (1 + rc) + min(b, i + wt) for f, b, i, wt in zip(
                        c.forward, c.backward, c.backward_input, c.backward_weight, strict=True))
                    chain = sum(f * (1 + rc) + min(b, i) for f, b, i in zip(
                        c.forward, c.backward, c.backward_input, strict=True))
                    w.bound0 = max(m * work / pp, chain) * (s.contention if beside(w.config)
                                                            else 1.0)
                    todo.append(w)
    # Best first: the candidate with the least bound is taken next, its bound refined by
    # splitting it before it is simulated, so that only candidates whose refined bound is the
    # least of all are simulated; once the least bound is beyond the fastest step by the near
    # ties' margin (the simplest near tie is chosen, not the fastest), the rest are pruned.
    heap = [(w.bound0, i, False, w) for i, w in enumerate(todo)]
    heapq.heapify(heap)
    progress.phase("searching", len(todo))
    counted = len(table)  # rows with a verdict so far (the impossible ones, before the search)
    best = math.inf
    evaluated: list[Work] = []
    results: list[tuple[Work, float, float, Timeline]] = []
    while heap:
        settled = len(table) + len(results)
        if settled > counted:  # each candidate counts once, when its verdict is in
            progress.advance(settled - counted)
            counted = settled
        bound, _, split, w = heapq.heappop(heap)
        reach = best * (1 + NEAR)
        if bound >= reach:
            table.append(_row(w, "pruned", f"lower bound {bound * 1e3:.2f} ms") if split else
                         Candidate(**vars(w.config), status="pruned",
                                   reason=f"even a perfect split takes >= "
                                          f"{bound * 1e3:.2f} ms", lower_bound=bound))
            continue
        if not split:
            if not s.evaluate(w, best=reach):
                evaluated.append(w)
                table.append(_row(w, "over budget"))
            elif w.bound >= reach:
                why = "" if w.balance is not None else " for any split"
                table.append(_row(w, "pruned", f"lower bound {w.bound * 1e3:.2f} ms{why}"))
            else:
                heapq.heappush(heap, (w.bound, _, True, w))
            continue
        got = s.simulate(w, reach)
        if got is None:
            table.append(_row(w, "pruned", f"at full speed already {w.bound * 1e3:.2f} ms"))
            continue
        step, exposed, timeline = got
        best = min(best, step)
        results.append((w, step, exposed, timeline))
    progress.advance(len(table) + len(results) - counted)
    for w, step, exposed, timeline in results:
        table.append(_row(w, "fits", w.reason, step, exposed, timeline))
    if last is not None:
        _simulate_last(s, table, todo, last)
    least, where = 0.0, ""
    if not results:
        least = math.inf
        for w in evaluated:
            if w.peaks is None:  # rejected before its peaks were counted: count them now
                s.evaluate(w, thorough=True)
            need = s.least_budget(w)
            if need < least:
                cfg = w.config
                least, where = need, (f"{cfg.label}, {cfg.shape}, chunks {cfg.chunks}, "
                                      f"checkpoint {cfg.checkpoint!r}")
    table.sort(key=_order)
    chosen = choose(table, last=last)
    if chosen is not None:
        table.remove(chosen)
        table.insert(0, _replace_status(chosen, "chosen"))
    return table, least, where


def _simulate_last(s: Evaluator, table: list[Candidate], todo: list[Work],
                   last: Configuration) -> None:
    """The last choice's row, split under the budget and simulated, when the search pruned it
    unsimulated: the choice weighs it re-predicted, however far from the fastest it fell."""
    key = identity(last)
    i = next((i for i, c in enumerate(table) if identity(c) == key and c.status == "pruned"),
             None)
    if i is None:
        return
    w = next(w for w in todo if identity(w.config) == key)
    if not s.evaluate(w, thorough=True):
        table[i] = _row(w, "over budget")
        return
    got = s.simulate(w)
    if got is not None:
        step, exposed, timeline = got
        table[i] = _row(w, "fits", w.reason, step, exposed, timeline)


def _row(w: Work, status: str, reason: str | None = None, step: float | None = None,
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
