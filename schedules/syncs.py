"""What a training step synchronises besides its messages: tied weights, dp and the scaler.

Pure data, given to `schedules.program` (which places the actions) and carried by the program
it builds, so that validate, simulate and the drawings know what the step must do without
asking the runtime. A weight tied across stages has one owner stage and copy stages; what
moves between an owner and one copy stage (all the weights they share, in the ties' order) is
one *link*, written `owner:copy`. Links are the unit of every tie action.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Syncs"]


@dataclass(frozen=True, slots=True)
class Syncs:
    """The synchronisations of one step.

    `ties`: per owner stage, the stages holding copies of its weights, `((owner, (copy, ...)),
    ...)`, owners increasing, copies increasing and distinct (`of` merges several ties).
    `dp`: gradients are averaged over data-parallel replicas (REDUCE_GRAD per stage, one
    AWAIT_GRAD per rank). `scaler`: a loss scaler's overflow is agreed by every rank (OVERFLOW).
    """

    ties: tuple[tuple[int, tuple[int, ...]], ...] = ()
    dp: bool = False
    scaler: bool = False

    def __post_init__(self) -> None:
        owners = [o for o, _ in self.ties]
        if owners != sorted(set(owners)):
            raise ValueError(f"Syncs.ties must list each owner stage once, increasing (got "
                             f"owners {owners}); Syncs.of merges ties")
        for owner, copies in self.ties:
            if owner < 0 or not copies or list(copies) != sorted(set(copies)) or min(
                    copies) < 0 or owner in copies:
                raise ValueError(f"a tie's owner stage {owner} needs distinct copy stages, "
                                 f"increasing, other than its own (got {copies})")

    @classmethod
    def of(cls, ties: Iterable[tuple[int, Iterable[int]]] = (), *, dp: bool = False,
           scaler: bool = False) -> Syncs:
        """From ties as `(owner stage, copy stages)`, one per tied weight, in any order."""
        merged: dict[int, set[int]] = {}
        for owner, copies in ties:
            merged.setdefault(owner, set()).update(copies)
        return cls(tuple((o, tuple(sorted(c))) for o, c in sorted(merged.items()) if c),
                   dp, scaler)

    @property
    def links(self) -> tuple[tuple[int, int], ...]:
        """Every (owner stage, copy stage), owner-major."""
        return tuple((o, c) for o, copies in self.ties for c in copies)

    @property
    def empty(self) -> bool:
        return not self.ties and not self.dp and not self.scaler

    def __str__(self) -> str:
        """`ties=0:3,5;1:2 dp scaler` (any part may be missing; `none` for nothing)."""
        parts = []
        if self.ties:
            parts.append("ties=" + ";".join(f"{o}:{','.join(map(str, c))}"
                                            for o, c in self.ties))
        parts += [name for name, on in (("dp", self.dp), ("scaler", self.scaler)) if on]
        return " ".join(parts) or "none"

    @classmethod
    def parse(cls, text: str) -> Syncs:
        """Read what `str(syncs)` writes."""
        ties: list[tuple[int, list[int]]] = []
        flags = {"dp": False, "scaler": False}
        for word in text.split():
            if word in flags:
                flags[word] = True
            elif word.startswith("ties="):
                try:
                    for item in word[len("ties="):].split(";"):
                        owner, _, copies = item.partition(":")
                        ties.append((int(owner), [int(c) for c in copies.split(",")]))
                except ValueError:
                    raise ValueError(f"bad ties {word!r}: expected ties=OWNER:COPY,COPY;... "
                                     f"with stage numbers, e.g. ties=0:3;1:2,4") from None
            elif word != "none":
                raise ValueError(f"bad syncs word {word!r}: expected ties=..., dp, scaler or "
                                 f"none, e.g. 'ties=0:3 dp'")
        return cls.of(ties, dp=flags["dp"], scaler=flags["scaler"])
