"""A replica's history of committed steps, carried in each average to catch replicas apart."""

from __future__ import annotations

import zlib

import torch

from pipeline.errors import PipelineError

__all__ = ["DIGITS", "ReplicasDiverged", "decode", "encode", "next_lineage"]

# A lineage is 24 bits, sent as 6 digits of 4 bits, one slot each. Each slot holds one
# replica's digit and zeros from the others, so the sum is the digit itself; torchft then
# divides by the participant count, and a digit of at most 15 over n, rounded to bfloat16's
# 8 bits, times n is within 15 * 2**-8 of the digit: rounding it back is exact in any float
# dtype a gradient may have.
DIGITS, _BITS = 6, 4


class ReplicasDiverged(PipelineError):
    """Replicas met in one quorum at the same step after committing steps apart."""


def next_lineage(lineage: int, step: int, members: tuple[int, ...]) -> int:
    """The lineage after committing `step` averaged over `members`: two replicas hold the same
    value exactly when they committed the same steps with the same members (up to a 2**-24
    chance of a collision)."""
    return zlib.crc32(repr((lineage, step, tuple(sorted(members)))).encode()) & 0xFFFFFF


def encode(lineage: int, replica: int, num_replicas: int, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """This replica's slots of the step's buffer: its lineage's digits at its own place,
    zeros at the others'."""
    slots = torch.zeros(num_replicas * DIGITS, dtype=torch.float32)
    for k in range(DIGITS):
        slots[replica * DIGITS + k] = float((lineage >> (_BITS * k)) & 0xF)
    return slots.to(device, dtype)


def decode(averaged: torch.Tensor, members: tuple[int, ...]) -> dict[int, int]:
    """Each member's lineage from the averaged slots (every member's digits divided by the
    member count)."""
    digits = (averaged.double() * len(members)).round().long().tolist()
    return {r: sum(int(digits[r * DIGITS + k]) << (_BITS * k) for k in range(DIGITS))
            for r in members}
