"""`pipeviz plan`: plan a model for a memory budget, print the candidates, draw the top two."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from schedules.files import FileRefused, write_atomic
from viz.usage import Parser, UsageError

if TYPE_CHECKING:
    from pipeline.planner.contention import Reading

__all__ = ["main", "parse_bytes", "parse_tp_plan", "resolve_model"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10,
          "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> float | None:
    """'512MiB' -> 536870912, '2GB' -> 2e9, '1e6' -> 1e6, 'none' -> None (unbounded)."""
    if text.strip().lower() in ("none", "inf", "unbounded"):
        return None
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not found or found.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected bytes like 512MiB, 2GB or 1000000 (or 'none'), got {text!r}")
    value = float(found.group(1)) * _UNITS[found.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory budget must be > 0 (got {text!r})")
    return value


def resolve_model(spec: str) -> tuple[Any, Any, Any, Any]:
    """'package.module:name[.attr...]' -> (model, sample, target, loss_fn). The object named
    is a function returning those four, or has `build()`, `batch()` and `loss()` (a benchmark
    `ModelSpec`, e.g. `pipeline.examples.models:MODELS.mlp`); a mapping is indexed by the next
    name."""
    module_name, sep, path = spec.partition(":")
    if not sep or not module_name or not path:
        raise UsageError(f"give the model as module:name (e.g. "
                          f"pipeline.examples.models:MODELS.mlp), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    for part in path.split("."):
        try:
            obj = obj[part] if isinstance(obj, Mapping) else getattr(obj, part)
        except (KeyError, AttributeError):
            raise UsageError(f"{spec}: no {part!r} in {module_name}") from None
    if all(hasattr(obj, a) for a in ("build", "batch", "loss")):
        sample, target = obj.batch()
        return obj.build(), sample, target, obj.loss()
    if callable(obj):
        got = obj()
        if isinstance(got, tuple) and len(got) == 4:
            return got
    raise UsageError(f"{spec} must be a function returning (model, sample, target, loss_fn) "
                      f"or an object with build(), batch() and loss()")


_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel",
           "sequence_parallel": "SequenceParallel"}


def parse_tp_plan(text: str) -> dict[str, str]:
    """'*.qkv=colwise,*.proj=rowwise' -> {'*.qkv': 'colwise', '*.proj': 'rowwise'}: module-name
    patterns and the style of each ('colwise', 'rowwise' or 'sequence_parallel')."""
    plan: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, sep, style = item.partition("=")
        if not sep or not pattern.strip() or style.strip() not in _STYLES:
            raise argparse.ArgumentTypeError(
                f"expected PATTERN=STYLE items like '*.qkv=colwise,*.proj=rowwise' (STYLE one "
                f"of {', '.join(_STYLES)}), got {item!r}")
        plan[pattern.strip()] = style.strip()
    if not plan:
        raise argparse.ArgumentTypeError("--tp-plan needs at least one PATTERN=STYLE")
    return plan


def _styles(plan: Mapping[str, str]) -> dict[str, Any]:
    """The parsed plan with torch's ParallelStyle objects, as Pipe(tp_plan=...) takes it."""
    from torch.distributed.tensor import parallel

    return {pattern: getattr(parallel, _STYLES[style])() for pattern, style in plan.items()}


def _say_load(reading: Reading | None) -> str:
    """One line on stderr: the profile's wall and CPU seconds and the load around it; returns
    why it was contended ('' if it was not)."""
    if reading is None:
        return ""
    from pipeline.planner import contention

    share, others = reading.cpu_share, reading.others_cores
    load = "unknown" if reading.load is None else f"{reading.load:.1f}"
    print(f"pipeviz plan: profiled and planned in {reading.wall_s:.1f} s, {reading.cpu_s:.1f} s "
          f"of CPU ({'-' if share is None else f'{share:.0%}'} of a thread); load average "
          f"{load} on {reading.cores} cores; other programs took "
          f"{'an unknown share' if others is None else f'{others:.2f}'} of the CPUs",
          file=sys.stderr)
    return "; ".join(reading.reasons(contention.CPU_SHARE_FLOOR))


class _Bar:
    """The planner's progress (`pipeline.planner.progress.Progress`) as tqdm bars on stderr,
    one a phase; silent with `disable`. Its `note` is said as the first phase starts: once
    the arguments have passed the planner's checks, before the measuring."""

    def __init__(self, *, disable: bool) -> None:
        self.disable = disable
        self.bar: Any = None
        self.note = ""

    def phase(self, name: str, total: int) -> None:
        from tqdm import tqdm

        self.close()
        if self.note:
            print(self.note, file=sys.stderr)
            self.note = ""
        self.bar = tqdm(total=total, desc=f"pipeviz plan: {name}", unit="step",
                        file=sys.stderr, disable=self.disable, dynamic_ncols=True, leave=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextlib.contextmanager
def _said_in_one_line(category: type[Warning]) -> Iterator[None]:
    """Warnings of `category` as one 'pipeviz plan: warning: ...' line each on stderr (not
    Python's two lines naming the source); others as Python shows them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", category)
        try:
            yield
        finally:
            for w in caught:
                if issubclass(w.category, category):
                    print(f"pipeviz plan: warning: {w.message}", file=sys.stderr)
                else:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers like 1,2,4 (got {text!r})") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 (got {text!r})")
    return values


def _parser() -> Parser:
    parser = Parser(prog="pipeviz plan", description=(
        "Profile a model, plan its pipeline (dp x pp, and x tp with --tp-plan) for a memory "
        "budget per rank, print the plan and every candidate, and draw the chosen schedule's "
        "predicted timeline beside the runner-up."))
    parser.add_argument("model", help="module:name giving (model, sample, target, loss_fn), "
                                      "e.g. pipeline.examples.models:MODELS.mlp")
    parser.add_argument("-p", "--ranks", type=int, required=True, help="ranks (devices)")
    parser.add_argument("-M", "--memory", type=parse_bytes, default=None,
                        help="budget per rank, e.g. 512MiB (default: unbounded)")
    parser.add_argument("--transport", choices=("threads", "gloo", "nccl"), default="threads",
                        help="how the ranks talk, which the link is measured over: threads "
                             "(one process, a thread per rank; default), gloo (a process per "
                             "rank, CPU) or nccl (a process per GPU); gloo and nccl also "
                             "search data parallelism")
    parser.add_argument("--schedules", type=lambda t: [s for s in t.split(",") if s],
                        help="comma-separated schedules (default: every registered one)")
    parser.add_argument("--chunks", type=_ints, help="micro-batch counts to try, e.g. 1,2,4,8")
    parser.add_argument("--tp-plan", type=parse_tp_plan, default=None, metavar="PLAN",
                        help="also split stages by tensor parallelism (dp x pp x tp; needs "
                             "--transport gloo or nccl): module-name patterns and styles, e.g. "
                             "'*.qkv=colwise,*.proj=rowwise'")
    parser.add_argument("--tp-sizes", type=_ints, default=None,
                        help="tensor-parallel sizes to try (default: every size dividing "
                             "--ranks-per-host)")
    parser.add_argument("--ranks-per-host", type=int, default=None,
                        help="ranks on one host; tp stays within a host (default: all ranks)")
    parser.add_argument("--optimizer", default="adam",
                        help="adam, adamw, sgd, momentum, rmsprop or adagrad (default adam)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads while profiling (default 1, as a CPU rank "
                             "trains: one thread's CPU time is then what a layer costs, "
                             "however busy the machine; 0: torch's own)")
    parser.add_argument("--show", type=int, default=20, metavar="N",
                        help="candidates to list in the table (0: all; default 20)")
    parser.add_argument("--rows", type=int, dest="rows_deprecated", default=None,
                        help=argparse.SUPPRESS)  # the old name of --show
    parser.add_argument("--fresh", action="store_true",
                        help="choose afresh: neither read nor write the last choice for this "
                             "model and settings (by default it is kept unless a candidate is "
                             "faster than it by more than the margin; it lives in "
                             "$PIPELINE_CACHE_DIR/plans, else the user's cache's "
                             "pipeline/plans)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (on stderr) while profiling and searching")
    parser.add_argument("-f", "--format", choices=("text", "svg", "png"), default=None,
                        help="the timelines' drawing (default: text, or -o's suffix)")
    parser.add_argument("-o", "--output", help="write the drawing here (svg or png)")
    parser.add_argument("--width", type=int, default=100, help="text width (default 100)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipeviz plan`; returns 0 planned, 1 nothing fits the budget, 2 bad arguments."""
    try:
        return _main(_parser().parse_args(argv))
    except UsageError as exc:
        print(f"pipeviz plan: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


def _main(args: argparse.Namespace) -> int:
    import torch  # planning profiles the model: torch only for this command

    from pipeline.planner import PlanError, contention, format_table, plan
    from pipeline.planner.remembered import RecallWarning
    from viz.compare import compare
    from viz.render_png import render_png
    from viz.render_svg import render_svg
    from viz.render_text import render_text

    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1 (got {args.ranks})")
    fmt = args.format or ("png" if (args.output or "").endswith(".png") else
                          "svg" if (args.output or "").endswith(".svg") else "text")
    if fmt == "png" and not args.output:
        raise UsageError("png is binary: give -o FILE.png")
    if args.rows_deprecated is not None:
        # The table's own `rows` column is rows per micro-batch: --rows read as that.
        print("pipeviz plan: warning: --rows is deprecated (the table's rows column is rows "
              "per micro-batch): use --show N for the candidates to list", file=sys.stderr)
        args.show = args.rows_deprecated
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0: torch's own), got {args.threads}")
    model, sample, target, loss_fn = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_timed = torch.get_num_threads() == 1 and all(
        p.device.type == "cpu" for p in model.parameters())
    bar = _Bar(disable=args.no_progress)
    busy = contention.high_load()
    if busy:  # before the time it takes, and whatever clock the profile reads
        how = ("the layers are timed by one thread's CPU time, which the load does not move, "
               "but the link is timed by the wall clock and planning takes longer"
               if cpu_timed else
               "the layers are timed by the wall clock (several threads, or a GPU), which "
               "the load slows: the plan may change with it; on CPU use --threads 1")
        bar.note = f"pipeviz plan: warning: {busy}: {how}"
    # The profile is timed: one thread's CPU time beside the wall time says whether the
    # process had a CPU while it was measured (pipeline/planner/contention.py).
    meter = contention.Meter(1)
    try:
        with meter, _said_in_one_line(RecallWarning):
            chosen = plan(model, sample, target, loss_fn, ranks=args.ranks,
                          memory_per_rank=args.memory, schedules=args.schedules,
                          optimizer=args.optimizer, transport=args.transport,
                          chunks=args.chunks,
                          tp_plan=_styles(args.tp_plan) if args.tp_plan else None,
                          tp_sizes=args.tp_sizes, ranks_per_host=args.ranks_per_host,
                          progress=bar, remember=False if args.fresh else None)
    except PlanError as exc:
        bar.close()
        print(f"pipeviz plan: {exc}", file=sys.stderr)
        _say_load(meter.reading)
        print(format_table(exc.candidates, args.show or None))
        return 1
    except ValueError as exc:
        bar.close()
        raise UsageError(str(exc)) from None
    bar.close()
    print(chosen.summary())
    flagged = _say_load(meter.reading)
    if flagged:  # beside the figures it puts in doubt
        print(f"{contention.MARK} profiled under contention ({flagged}): the times above are "
              f"not reliable; rerun on an idle machine")
    print()
    print(chosen.table(args.show or None))
    print()
    timelines = [chosen.timeline]
    runner_up = chosen.runner_up
    if runner_up is not None:
        timelines.append(chosen.timeline_of(runner_up))
    drawing = compare(timelines, title="chosen vs runner-up" if runner_up else "chosen",
                      ranked=runner_up is not None)
    drawing = dataclasses.replace(drawing, subtitle=f"predicted (simulated from the profile), "
                                                    f"times in {drawing.unit_name()}")
    content: str | bytes
    if fmt == "text":
        content = render_text(drawing, width=max(40, args.width))
    elif fmt == "svg":
        content = render_svg(drawing)
    else:
        try:
            content = render_png(drawing)
        except RuntimeError as exc:  # no Pillow
            raise UsageError(str(exc)) from None
    if args.output is None:
        assert isinstance(content, str)
        print(content, end="")
        return 0
    try:
        write_atomic(args.output, content)
    except FileRefused as exc:
        raise UsageError(f"cannot write {args.output}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    return 0
