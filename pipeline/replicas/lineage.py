"""A replica's history of committed steps and of its state, carried in each average to catch
replicas apart."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from pipeline.errors import PipelineError

__all__ = ["DIGITS", "ReplicasDiverged", "decode", "encode", "next_lineage", "state_digest"]

# A lineage is 24 bits, sent as 6 digits of 4 bits, one slot each. Each slot holds one
# replica's digit and zeros from the others, so the sum is the digit itself; torchft then
# divides by the participant count, and a digit of at most 15 over n, rounded to bfloat16's
# 8 bits, times n is within 15 * 2**-8 of the digit: rounding it back is exact in any float
# dtype a gradient may have.
DIGITS, _BITS = 6, 4


class ReplicasDiverged(PipelineError):
    """Replicas met in one quorum at the same step after committing steps apart."""


def next_lineage(lineage: int, step: int, members: tuple[int, ...], digest: int = 0) -> int:
    """The lineage after committing `step` averaged over `members`, from a state whose
    `state_digest` was `digest`: two replicas hold the same value exactly when they committed
    the same steps with the same members from the same states (up to a 2**-24 chance of a
    collision). The digest ties the history to weights, not to step numbers alone: a group
    whose ranks were healed from different steps, or that holds other weights under the same
    step numbers, extends another lineage."""
    return zlib.crc32(repr((lineage, step, tuple(sorted(members)), digest)).encode()) & 0xFFFFFF


_CHUNK = 1 << 22  # elements digested at a time (three int64 copies of it at most)
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def state_digest(tensors: Iterable[torch.Tensor]) -> int:
    """A 32-bit digest of the tensors' bits, in order: equal for bit-identical states.

    Computed where the tensors live (a GPU's weights are not copied to the host): each
    tensor's bits read as integers, their sum and their sum weighted by position modulo a
    prime (a permutation moves it), exact in int64 (wrapping alike everywhere); one transfer
    of two integers per tensor at the end. A checksum, not a cryptographic hash: it tells a
    state from another state, not from a forgery (the job's TLS keeps strangers out)."""
    parts = []
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        ints = flat.view(_INT_OF[flat.element_size()])
        total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for start in range(0, ints.numel(), _CHUNK):  # bounded scratch memory per tensor
            bits = ints[start:start + _CHUNK].to(torch.int64)
            where = (torch.arange(start, start + bits.numel(), device=bits.device,
                                  dtype=torch.int64) % 65521) + 1
            total += torch.stack([bits.sum(), (bits * where).sum()])
        parts.append(total)
    if not parts:
        return 0
    return zlib.crc32(repr(torch.stack(parts).cpu().tolist()).encode())


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
