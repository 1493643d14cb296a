"""The registry of schedule generators: names, functions and their metadata; `get_schedule`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from schedules.ir import Schedule, ScheduleError

__all__ = ["Generator", "GeneratorInfo", "available", "get_schedule", "info", "options",
           "register"]

Generator = Callable[..., Schedule]


@dataclass(frozen=True, slots=True)
class GeneratorInfo:
    """What a runtime needs to know about a generator, so that nothing branches on its name.

    `stages_per_rank` is how many stages each rank holds; when `stages_option` names one of the
    generator's options, that option sets the count instead (and `stages_per_rank` is its
    default). `batches_option` names the option that runs several batches without a flush
    (weight-versioned schedules such as PipeDream-2BW); None means one batch per schedule.
    """

    name: str
    fn: Generator
    options: tuple[str, ...]
    stages_per_rank: int = 1
    stages_option: str | None = None
    batches_option: str | None = None
    synthesised: bool = False  # built for given costs (`schedules.auto`), not a fixed shape

    @property
    def multi_batch(self) -> bool:
        return self.batches_option is not None

    def options_for(self, *, stages_per_rank: int, num_batches: int = 1) -> dict[str, int]:
        """The options that make this generator produce `stages_per_rank` stages per rank over
        `num_batches` batches; a `ScheduleError` if it cannot."""
        out: dict[str, int] = {}
        if self.stages_option is not None:
            out[self.stages_option] = stages_per_rank
        elif stages_per_rank != self.stages_per_rank:
            raise ScheduleError(f"schedule {self.name!r} places {self.stages_per_rank} stage(s) "
                                f"per rank (got a request for {stages_per_rank})")
        if self.batches_option is not None:
            out[self.batches_option] = num_batches
        elif num_batches != 1:
            raise ScheduleError(f"schedule {self.name!r} runs one batch at a time (got "
                                f"num_batches={num_batches}); multi-batch schedules such as "
                                f"'2bw' declare a batches_option")
        return out


_GENERATORS: dict[str, GeneratorInfo] = {}


def register(name: str, *, stages_per_rank: int = 1, stages_option: str | None = None,
             batches_option: str | None = None, synthesised: bool = False
             ) -> Callable[[Generator], Generator]:
    """Register `fn(num_ranks, num_microbatches, **options) -> Schedule` under `name`.

    Declare what the schedule needs from a runtime: `stages_per_rank` (fixed), or
    `stages_option` (the option that sets it, e.g. interleaved's "stages_per_rank"), and
    `batches_option` for schedules that run several batches without a flush (2bw's
    "num_batches"), and `synthesised` for a schedule built for given costs (`auto`), which the
    planner synthesises per split. `Pipe` reads these instead of the name.
    """
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1 (got {stages_per_rank!r})")

    def wrap(fn: Generator) -> Generator:
        if name in _GENERATORS:
            raise ValueError(f"schedule {name!r} is already registered")
        accepted = _option_names(fn)
        for what, option in (("stages_option", stages_option),
                             ("batches_option", batches_option)):
            if option is not None and option not in accepted:
                raise ValueError(f"{what}={option!r} is not an option of {fn.__name__} "
                                 f"(its options: {', '.join(accepted) or 'none'})")
        _GENERATORS[name] = GeneratorInfo(name, fn, accepted, stages_per_rank, stages_option,
                                          batches_option, synthesised)
        return fn

    return wrap


def available() -> tuple[str, ...]:
    """Names accepted by `get_schedule`: the built-in ones in `_BUILTINS`' order (whichever
    module was imported first), then the others in registration order."""
    _load_builtins()
    names = list(_GENERATORS)

    def place(name: str) -> tuple[int, int]:
        module = _GENERATORS[name].fn.__module__.removeprefix("schedules.")
        builtin = _BUILTINS.index(module) if module in _BUILTINS else len(_BUILTINS)
        return builtin, names.index(name)

    return tuple(sorted(names, key=place))


def info(name: str) -> GeneratorInfo:
    """The generator registered as `name` with its metadata."""
    _load_builtins()
    found = _GENERATORS.get(name)
    if found is None:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(available())}")
    return found


def options(name: str) -> tuple[str, ...]:
    """The keyword options the generator `name` accepts (e.g. `("stages_per_rank",)`)."""
    return info(name).options


def _option_names(fn: Generator) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters
                 if p not in ("num_ranks", "num_microbatches"))


def get_schedule(name: str, num_ranks: int, num_microbatches: int, **options: int) -> Schedule:
    """Generate the schedule `name` for `num_ranks` ranks and `num_microbatches` micro-batches.

    Options: `stages_per_rank` (interleaved), `num_batches` (2bw).
    """
    gen = info(name)
    unknown = sorted(set(options) - set(gen.options))
    if unknown:
        raise ScheduleError(f"schedule {name!r} takes no option {', '.join(unknown)}; "
                            f"it accepts: {', '.join(gen.options) or 'none'}")
    for what, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                        *options.items()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {what} must be an int >= 1 (got {value!r})")
    return gen.fn(num_ranks, num_microbatches, **options)


_BUILTINS = ("gpipe", "one_f_one_b", "interleaved", "pipedream_2bw", "zero_bubble",
             "v_shape", "auto")


def _load_builtins() -> None:
    # Importing a generator module registers it; lazily, so the registry imports none of them,
    # and in this order, so `available()` lists the classics first.
    for module in _BUILTINS:
        importlib.import_module(f"schedules.{module}")
