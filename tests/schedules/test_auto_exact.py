"""The exact search of schedules/auto_exact.py against brute force, and the heuristic's gap
to it: `auto` is never better than the optimum (that would be a bug in one of them), and the
figures are printed (run with -s)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

import schedules
from schedules import Action, Costs, Op, Schedule, ScheduleError
from schedules.auto import search
from schedules.auto_exact import optimum


def _costs(rng: random.Random, p: int) -> Costs:
    """Unequal per-stage F, I, W in quarters (0.25 to 2), B = I + W, comm 0 to 0.5."""
    def quarters() -> list[float]:
        return [rng.randint(1, 8) / 4 for _ in range(p)]

    f, i, w = quarters(), quarters(), quarters()
    return Costs(forward=f, backward_input=i, backward_weight=w,
                 backward=[a + b for a, b in zip(i, w, strict=True)],
                 comm=rng.randint(0, 2) / 4)


def _rank_orders(r: int, m: int) -> Iterator[tuple[Action, ...]]:
    """Every order of rank r's F, I and W with each kind in micro-batch order, I(k) after
    F(k) and W(k) after I(k): the sequences of F/I/W counts that never run ahead."""
    def walk(nf: int, ni: int, nw: int, row: tuple[Action, ...]) -> Iterator[tuple[Action, ...]]:
        if nw == m:
            yield row
            return
        if nf < m:
            yield from walk(nf + 1, ni, nw, (*row, Action(r, Op.F, nf)))
        if ni < nf:
            yield from walk(nf, ni + 1, nw, (*row, Action(r, Op.I, ni)))
        if nw < ni:
            yield from walk(nf, ni, nw + 1, (*row, Action(r, Op.W, nw)))

    return walk(0, 0, 0, ())


def _brute_force(p: int, m: int, costs: Costs, limit: int | None) -> float:
    best = float("inf")
    for rows in itertools.product(*(list(_rank_orders(r, m)) for r in range(p))):
        s = Schedule(p, p, m, rows)
        if max(schedules.peak_activations(rows)) > (limit or m):
            continue
        try:
            best = min(best, schedules.simulate(s, costs).makespan)
        except ScheduleError:
            continue  # deadlocks
    return best


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 3), (3, 2)])
def test_exact_search_equals_brute_force(p: int, m: int) -> None:
    rng = random.Random(p * 10 + m)
    for _ in range(4):
        costs, limit = _costs(rng, p), rng.choice([None, 1, 2])
        found = optimum(p, m, costs, limit)
        assert found.makespan == _brute_force(p, m, costs, limit)
        schedules.validate(schedules.lower(found.schedule))
        assert schedules.simulate(found.schedule, costs).makespan == found.makespan
        assert max(schedules.peak_activations(found.schedule.actions)) <= (limit or m)


def test_heuristic_against_the_optimum() -> None:
    # 32 problems, p <= 3, m <= 4, unequal stages, limits of 2, p or none: the optimum is
    # never above the heuristic (both simulated), and the gap is printed.
    rng = random.Random(2024)
    ratios = []
    for p, m in [(2, 3), (2, 4), (3, 3), (3, 4)] * 8:
        costs, limit = _costs(rng, p), rng.choice([None, 2, p])
        heuristic = search(p, m, costs, limit)
        exact = optimum(p, m, costs, limit, upper=(heuristic.makespan, heuristic.schedule),
                        max_nodes=400_000)
        assert exact.makespan <= heuristic.makespan
        ratios.append(heuristic.makespan / exact.makespan)
    optimal = sum(r == 1.0 for r in ratios)
    print(f"\nauto / optimum over {len(ratios)} problems (p <= 3, m <= 4): optimal in "
          f"{optimal}, mean {sum(ratios) / len(ratios):.4f}, worst {max(ratios):.4f}")
