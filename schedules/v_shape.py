"""V-shape schedules: two stages per rank, rank r holding stages r and 2p - 1 - r (ZB-V, DualPipeV).

The V placement puts the first and the last stage on rank 0, so a micro-batch's forward goes
down the ranks and comes back up, and its backward does the same in reverse: the last stage's
gradient is ready where the first stage waits for it. Each stage is half of a rank's share of
the model, so at unit costs per stage a rank does 6m units of work per step.
"""

from __future__ import annotations

from collections import deque

from schedules.ir import Action, Op, Schedule
from schedules.registry import register

__all__ = ["dualpipe_v", "zb_v"]


_B, _I, _W = Op.B, Op.I, Op.W


class _Order:
    """One rank's action list, numbering each (stage, op)'s micro-batches in turn.

    A full backward B counts as that stage's next I (and its W); W takes the oldest micro-batch
    whose I ran and whose W has not, of one stage or of any.
    """

    def __init__(self) -> None:
        self.row: list[Action] = []
        self._next: dict[tuple[int, Op], int] = {}
        # Per stage, (when, micro-batch) of each I awaiting its W, oldest first.
        self._pending: dict[int, deque[tuple[int, int]]] = {}
        self._clock = 0

    def count(self, stage: int, op: Op) -> int:
        return self._next.get((stage, _I if op is _B else op), 0)

    def add(self, stage: int, op: Op) -> None:
        key = (stage, _I if op is _B else op)
        mb = self._next.get(key, 0)
        self._next[key] = mb + 1
        if op is _I:
            self._pending.setdefault(stage, deque()).append((self._clock, mb))
            self._clock += 1
        self.row.append(Action(stage, op, mb))

    def weight(self, stage: int | None = None) -> None:
        """The W of the oldest pending micro-batch (of `stage`, if given); none pending: nothing."""
        if stage is None:
            oldest = min(((q[0][0], s) for s, q in self._pending.items() if q), default=None)
            if oldest is None:
                return
            stage = oldest[1]
        pending = self._pending.get(stage)
        if pending:
            self.row.append(Action(stage, _W, pending.popleft()[1]))

    def drain(self, stage: int | None = None) -> None:
        """The W's of every pending micro-batch (of `stage`, if given), oldest first."""
        stages = list(self._pending) if stage is None else [stage]
        found = sorted((when, s, mb) for s in stages for when, mb in self._pending.get(s, ()))
        for s in stages:
            self._pending.pop(s, None)
        self.row += [Action(s, _W, mb) for _, s, mb in found]


@register("zb-v", stages_per_rank=2)
def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (the paper's section 6): zero-bubble over the V placement, 1F1B's peak memory.

    Rank r (down-leg stage r, up-leg stage 2p - 1 - r): 2(p - r) - 1 forwards of stage r; r
    pairs of forwards, up leg then down; p - r rounds of up-leg F, I, W; then the steady
    state, each round a down-leg F, I, W and an up-leg F, I, W; then the cool-down: r pairs
    of I's (up, down), p - r down-leg I, W's and the remaining W's. The order is built for
    max(m, 2p - 1) micro-batches and the actions of micro-batches >= m are left out (torch's
    `ScheduleZBVZeroBubble` does the same). Unit costs per stage (F = I = W = 1, B = 2):
    makespan max(6m + p - 1, 4m + 4p - 2), so 6m + p - 1 for m >= 2p - 1: half ZB-H1's
    bubble, each stage being half a rank's share. Peak on rank r: min(2p, m + r + 1, 2m)
    stage micro-batches alive; at most 2p halves, that is p micro-batches of a whole rank's
    share, 1F1B's peak (on rank 0). p=2, m=4 (rank 0: stages 0, 3; rank 1: stages 1, 2)::

        r0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3
            0I2 0W2 0I3 0W3
        r1  1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3
            1I3 1W2 2W3 1W3
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    rows = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        o = _Order()
        for _ in range(2 * (p - r) - 1):
            o.add(down, Op.F)
        for _ in range(r):
            o.add(up, Op.F)
            o.add(down, Op.F)
        for _ in range(p - r):
            _fiw(o, up)
        while o.count(up, Op.F) < o.count(down, Op.F) or o.count(down, Op.F) < n:
            if o.count(down, Op.F) < n:
                o.add(down, Op.F)
            o.add(down, Op.I)
            o.weight(down)
            _fiw(o, up)
        for _ in range(r):
            o.add(down, Op.I)
            o.add(up, Op.I)
        for _ in range(p - r):
            o.add(down, Op.I)
            o.weight(down)
        o.drain(up)
        o.drain(down)
        rows.append(tuple(a for a in o.row if a.microbatch < m))
    return Schedule(p, 2 * p, m, tuple(rows), placement="v", name="zb-v")


def _fiw(o: _Order, stage: int) -> None:
    o.add(stage, Op.F)
    o.add(stage, Op.I)
    o.weight(stage)


@register("dualpipe-v", stages_per_rank=2)
def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DeepSeek's DualPipeV as torch 2.13's `ScheduleDualPipeV` orders it.

    Rank r (stages r and 2p - 1 - r): 2(p - r - 1) down-leg forwards; r + 1 pairs of forwards
    (down, up); p - r - 1 rounds of up-leg I, a pending W, up-leg F; then the main phase,
    m - 2p + r + 1 rounds each of two overlapped pairs, a forward of one leg next to the full
    backward B of the other (down F with up B, up F with down B; torch runs each pair as one
    `OVERLAP_F_B` action, here the two are adjacent and run in order); p - r - 1 rounds of
    up-leg B and an overlapped pair; r + 1 backward pairs (up, down), full B in the first half
    and split into I with a deferred W in the second; and the deferred W's. torch needs
    m >= 2p; here m < 2p gets the order for 2p micro-batches with the actions of micro-batches
    >= m left out (as torch's ZB-V does), which stays complete and deadlock-free. Unit costs
    per stage: makespan 6m + p - 1 for m >= 2p (ZB-V's; the overlap pays off where a runtime
    runs a pair's compute and communication at once), max(6m + p - 1, 4m + 5p - 3 + 2[m > p])
    for any m. Peak on rank r: min(2p + 1, m + r + 1, 2m) stage micro-batches alive, one more
    than ZB-V. p=2, m=4 (rank 0: stages 0, 3; rank 1: stages 1, 2)::

        r0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
        r1  1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p)
    rows = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        o = _Order()
        for _ in range(2 * (p - r - 1)):
            o.add(down, Op.F)
        for _ in range(r + 1):
            o.add(down, Op.F)
            o.add(up, Op.F)
        for _ in range(p - r - 1):
            o.add(up, Op.I)
            o.weight()
            o.add(up, Op.F)
        for _ in range(n - 2 * p + r + 1):
            o.add(down, Op.F)
            o.add(up, Op.B)
            o.add(up, Op.F)
            o.add(down, Op.B)
        for _ in range(p - r - 1):
            o.add(up, Op.B)
            o.add(up, Op.F)
            o.add(down, Op.B)
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            # The second half of the last backwards is split, so W's fill the cool-down.
            split = split or (i == half and r % 2 == 1)
            o.add(up, Op.I if split else Op.B)
            split = split or (i == half and r % 2 == 0)
            o.add(down, Op.I if split else Op.B)
        for _ in range(p - r - 1):
            o.weight()
            o.add(down, Op.I if split else Op.B)
        o.drain()
        rows.append(tuple(a for a in o.row if a.microbatch < m))
    return Schedule(p, 2 * p, m, tuple(rows), placement="v", name="dualpipe-v")
