"""The registry of schedule generators: names to functions, and `get_schedule`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from schedules.ir import Schedule, ScheduleError

__all__ = ["Generator", "available", "get_schedule", "options", "register"]

Generator = Callable[..., Schedule]
_GENERATORS: dict[str, Generator] = {}


def register(name: str) -> Callable[[Generator], Generator]:
    """Register `fn(num_ranks, num_microbatches, **options) -> Schedule` under `name`."""

    def wrap(fn: Generator) -> Generator:
        if name in _GENERATORS:
            raise ValueError(f"schedule {name!r} is already registered")
        _GENERATORS[name] = fn
        return fn

    return wrap


def available() -> tuple[str, ...]:
    """Names accepted by `get_schedule`, in registration order."""
    _load_builtins()
    return tuple(_GENERATORS)


def options(name: str) -> tuple[str, ...]:
    """The keyword options the generator `name` accepts (e.g. `("stages_per_rank",)`)."""
    _load_builtins()
    fn = _GENERATORS.get(name)
    if fn is None:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(_GENERATORS)}")
    return _option_names(fn)


def _option_names(fn: Generator) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters
                 if p not in ("num_ranks", "num_microbatches"))


def get_schedule(name: str, num_ranks: int, num_microbatches: int, **options: int) -> Schedule:
    """Generate the schedule `name` for `num_ranks` ranks and `num_microbatches` micro-batches.

    Options: `stages_per_rank` (interleaved), `num_batches` (2bw).
    """
    _load_builtins()
    fn = _GENERATORS.get(name)
    if fn is None:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(_GENERATORS)}")
    accepted = _option_names(fn)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ScheduleError(f"schedule {name!r} takes no option {', '.join(unknown)}; "
                            f"it accepts: {', '.join(accepted) or 'none'}")
    for what, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                        *options.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {what} must be an int >= 1 (got {value!r})")
    return fn(num_ranks, num_microbatches, **options)


_BUILTINS = ("gpipe", "one_f_one_b", "interleaved", "pipedream_2bw", "zero_bubble")


def _load_builtins() -> None:
    # Importing a generator module registers it; lazily, so the registry imports none of them,
    # and in this order, so `available()` lists the classics first.
    for module in _BUILTINS:
        importlib.import_module(f"schedules.{module}")
