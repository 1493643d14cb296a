"""The memory model: bytes a rank holds under a schedule, from the profile and the action order.

A rank holds, per stage: its parameters and buffers, a gradient per trainable parameter, the
optimizer's state, two more weight copies under a weight-versioned schedule (PipeDream-2BW's
previous and current versions), a flat copy of the gradients while they are averaged over data
parallel replicas; and, for each micro-batch between its forward and the end of its backward,
the stage's input plus, unless the micro-batch is recomputed, what autograd saved. A recomputed
micro-batch holds the saved tensors again from the replay to the end of its backward (until W
when the backward is split). This is what the runtime counts with `track_memory=True`
(`Pipe.memory_stats()`'s stash) plus the static part and the replay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from schedules import Op, Schedule

__all__ = ["OPTIMIZERS", "checkpointed", "format_bytes", "optimizer_factor", "rank_peaks",
           "stash_profile"]

# Optimizer state: bytes per byte of trainable parameter (torch's implementations keep their
# state in the parameter's dtype), and bytes per parameter tensor (Adam's and Adagrad's `step`
# counter, a float32 scalar each).
OPTIMIZERS = {"adam": (2.0, 4), "adamw": (2.0, 4), "sgd": (0.0, 0), "momentum": (1.0, 0),
              "rmsprop": (1.0, 4), "adagrad": (1.0, 4)}


def optimizer_factor(optimizer: str | float) -> tuple[float, int]:
    """(state bytes per trainable parameter byte, bytes per parameter tensor) of a named
    optimizer; a number gives the first and no per-tensor state."""
    if isinstance(optimizer, int | float) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer state per parameter byte must be >= 0 (got {optimizer})")
        return float(optimizer), 0
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)} or the bytes of state "
                         f"per parameter byte as a number (got {optimizer!r})")
    return OPTIMIZERS[str(optimizer)]


def checkpointed(mode: str, num_microbatches: int, num_batches: int = 1) -> list[bool]:
    """Which micro-batches a checkpoint mode recomputes (as `Pipe` decides it)."""
    m = num_microbatches
    return [mode == "always" or (mode == "except_last" and k % m != m - 1)
            for k in range(m * num_batches)]


def stash_profile(schedule: Schedule, recompute: Sequence[bool]
                  ) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per stage, the (inputs held, saved graphs held) counts at the moments either could
    peak, keeping only pairs no other pair dominates: a stage whose input is `x` bytes and
    whose saved tensors are `g` bytes per micro-batch peaks at `max(a * x + b * g)`."""
    counts: dict[int, list[int]] = {}
    seen: dict[int, set[tuple[int, int]]] = {}
    for row in schedule.actions:
        for a in row:
            if a.op not in (Op.F, Op.B, Op.I, Op.W):
                continue
            held = counts.setdefault(a.stage, [0, 0])
            pairs = seen.setdefault(a.stage, set())
            again = recompute[a.microbatch]  # micro-batches count on across batches
            if a.op is Op.F:
                held[0] += 1
                held[1] += 0 if again else 1
                pairs.add((held[0], held[1]))
            elif a.op is Op.B:
                if again:  # the replay's graph lives until this backward ends
                    pairs.add((held[0], held[1] + 1))
                held[0] -= 1
                held[1] -= 0 if again else 1
            elif a.op is Op.I:
                if again:  # replayed here; what W needs stays until W
                    held[1] += 1
                    pairs.add((held[0], held[1]))
            else:  # W
                held[0] -= 1
                held[1] -= 1
    return {s: _frontier(p) for s, p in seen.items()}


def _frontier(pairs: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    kept: list[tuple[int, int]] = []
    for a, b in sorted(pairs, reverse=True):
        if not kept or b > kept[-1][1]:
            kept.append((a, b))
    return tuple(kept)


def rank_peaks(schedule: Schedule, recompute: Sequence[bool], inputs: Sequence[float],
               saved: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most activation bytes held at once, walking its actions in order, given
    each stage's input bytes and saved bytes per micro-batch."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0.0
        for a in row:
            if a.op not in (Op.F, Op.B, Op.I, Op.W):
                continue
            again = recompute[a.microbatch]  # micro-batches count on across batches
            x, g = inputs[a.stage], saved[a.stage]
            if a.op is Op.F:
                live += x + (0.0 if again else g)
            elif a.op is Op.B:
                if again:
                    peak = max(peak, live + g)
                live -= x + (0.0 if again else g)
            elif a.op is Op.I:
                live += g if again else 0.0
            else:
                live -= x + g
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def format_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB'; inf -> 'unbounded'."""
    if math.isinf(nbytes):
        return "unbounded"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"
