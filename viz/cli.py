"""The `pipeviz` command: draw a named schedule, a CSV schedule or a measured timeline."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import schedules
from schedules import Costs, Schedule, ScheduleError, Syncs, Timeline
from schedules.files import FileRefused, write_atomic
from viz.compare import Comparison, compare
from viz.layout import Layout, format_costs, layout
from viz.limits import (
    check_costs,
)
from viz.measured import over_predicted
from viz.render_dot import MAX_NODES, dot_to_image, render_dot
from viz.render_png import render_png
from viz.render_svg import render_svg
from viz.render_text import render_text
from viz.sources import DEFAULT_MICROBATCHES, DEFAULT_RANKS, load
from viz.usage import Parser, UsageError

__all__ = ["main"]

FORMATS = ("text", "svg", "png", "chrome", "dot", "json")
_BY_SUFFIX = {".txt": "text", ".svg": "svg", ".png": "png", ".json": "chrome", ".dot": "dot",
              ".gv": "dot"}
_DOT_IMAGES = (".svg", ".png", ".pdf")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _syncs(text: str) -> Syncs:
    try:
        return Syncs.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _costs(text: str) -> Costs:
    try:
        return check_costs(Costs.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> Parser:
    names = ", ".join(schedules.available())
    parser = Parser(
        prog="pipeviz",
        usage="pipeviz [options] SOURCE\n"
              "       pipeviz compare SOURCE SOURCE [SOURCE ...] [options]\n"
              "       pipeviz plan MODEL [options]   (pipeviz plan --help)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Draw a pipeline schedule, planned (simulated under a cost model) or "
                    "measured (a timeline a training run wrote).",
        epilog=f"""\
sources:
  a schedule name ({names}),
  a CSV schedule (ours or torch.distributed.pipelining's: a row per rank, cells like 0F1),
  or a timeline JSON ("format": "pipeline-timeline/1", written by a run or by --format json).

examples:
  pipeviz 1f1b --ranks 4 --microbatches 8
  pipeviz zb-h1 -p 4 -m 8 --costs F=1,I=1,W=1,comm=0.1 -o zb-h1.svg
  pipeviz interleaved -p 4 -m 8 --stages-per-rank 2 -o interleaved.png
  pipeviz 2bw -p 4 -m 4 --batches 3
  pipeviz schedule.csv
  pipeviz timeline.json -o run.svg
  pipeviz timeline.json --predicted -o run.svg              (measured over predicted)
  pipeviz 1f1b -p 4 -m 8 --format chrome -o trace.json      (open in ui.perfetto.dev)
  pipeviz 1f1b -p 2 -m 3 --format dot -o graph.svg          (dependency graph, critical path)
  pipeviz compare gpipe 1f1b interleaved zb-h1 -p 4 -m 8 --format svg -o compare.svg
  pipeviz plan pipeline.examples.models:MODELS.mlp --ranks 2 --memory 80MiB   (pipeviz plan --help)

exit status: 0 drawn; 1 the schedule is invalid (drawn, failing step marked); 2 bad arguments.""",
    )
    parser.add_argument("sources", nargs="+", metavar="SOURCE",
                        help="a schedule name, a .csv schedule or a .json timeline; "
                             "or 'compare' followed by several of them")
    parser.add_argument("-p", "--ranks", type=_positive,
                        help=f"pipeline ranks (named schedules; default {DEFAULT_RANKS})")
    parser.add_argument("-m", "--microbatches", type=_positive,
                        help=f"micro-batches per batch (default {DEFAULT_MICROBATCHES}; for a "
                             f"multi-batch CSV, its micro-batches per batch)")
    parser.add_argument("-v", "--stages-per-rank", type=_positive,
                        help="virtual stages per rank (interleaved)")
    parser.add_argument("-n", "--batches", type=_positive, help="batches without a flush (2bw)")
    parser.add_argument("--costs", type=_costs, default=None,
                        help="op durations, e.g. F=1,B=2,I=1,W=1,U=0,comm=0.1 (default "
                             "F=1,B=2,I=1,W=1,U=0,comm=0)")
    parser.add_argument("--lower", action="store_true",
                        help="insert the SEND/RECV actions before drawing")
    parser.add_argument("--predicted", action="store_true",
                        help="a measured timeline: draw it above the simulator's prediction of "
                             "the same step (its schedule from the timeline, each op's median "
                             "duration per stage and the median message delay as costs); "
                             "with --format json, write the prediction")
    parser.add_argument("--syncs", type=_syncs, default=None, metavar="SYNCS",
                        help="draw the step's program with these syncs placed, e.g. "
                             "'ties=0:3 dp scaler' (tied weights of stage 0 copied on stage 3, "
                             "dp gradient reductions, the scaler's agreement)")
    parser.add_argument("-f", "--format", choices=FORMATS,
                        help="text (default), svg, png, chrome (trace JSON), dot (dependency "
                             "graph), json (timeline); guessed from -o's suffix when omitted")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    parser.add_argument("--width", type=_positive,
                        help="text: columns (default: the terminal's width)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="text: ANSI colours (auto: on a terminal, unless NO_COLOR is set)")
    parser.add_argument("--max-nodes", type=_positive, default=MAX_NODES,
                        help=f"dot: refuse graphs with more actions (default {MAX_NODES})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run pipeviz; returns the exit status (0 drawn, 1 invalid schedule, 2 bad arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["plan"]:  # profiles a model: torch is imported for this command only
        from viz.plan import main as plan_main

        return plan_main(args[1:])
    try:
        return _main(_parser().parse_args(args))
    except UsageError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the cause wrote
        print(f"pipeviz: error: {message} (see pipeviz --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


def _main(args: argparse.Namespace) -> int:
    sources = list(args.sources)
    comparing = sources[0] == "compare"
    if comparing:
        sources = sources[1:]
        if not sources:
            raise UsageError("compare needs at least one schedule, CSV or timeline")
    elif len(sources) > 1:
        raise UsageError(f"give one source, not {len(sources)} (to draw several on one time "
                          f"axis: pipeviz compare {' '.join(sources)})")
    fmt = args.format or _BY_SUFFIX.get(Path(args.output or "").suffix.lower(), "text")
    if fmt == "png" and not args.output:
        raise UsageError("png is binary: give -o FILE.png")
    if comparing and fmt not in ("text", "svg", "png"):
        raise UsageError(f"compare draws text, svg or png, not {fmt}")
    used: set[str] = set()
    loaded = [load(source, args, lenient=comparing, used=used) for source in sources]
    for attr, flag in (("stages_per_rank", "--stages-per-rank"), ("batches", "--batches")):
        if comparing and getattr(args, attr) is not None and attr not in used:
            # Comparing, an option no compared schedule takes is a mistake, not a default.
            raise UsageError(f"{flag} applies to none of {', '.join(sources)}")
    if args.predicted:
        return _predicted(loaded, sources, args, fmt, comparing)
    costs = args.costs or Costs()
    if fmt == "dot":
        return _dot(loaded[0], args, costs)
    target: Layout | Comparison
    try:
        if comparing:
            target = compare(loaded, costs=costs, subtitle=_compare_subtitle(loaded, costs))
        else:
            target = layout(loaded[0], costs=costs)
    except ValueError as exc:  # e.g. per-stage costs that do not match the stages
        raise UsageError(str(exc)) from None
    layouts = target.layouts if isinstance(target, Comparison) else (target,)
    if fmt in ("text", "svg", "png"):
        _draw(args, fmt, target)
    else:
        assert isinstance(target, Layout) and target.timeline is not None
        timeline = target.timeline
        if isinstance(loaded[0], Schedule):
            meta = {**timeline.meta, "costs": format_costs(costs)}
            timeline = Timeline(timeline.num_ranks, timeline.events, timeline.unit, meta)
        if fmt == "json":
            _write(args, timeline.to_json() + "\n")
        else:
            trace = timeline.to_chrome_trace()
            if target.failure is not None:
                trace["metadata"]["invalid"] = target.failure.message
            _write(args, json.dumps(trace) + "\n")
    failed = [lay for lay in layouts if lay.failure is not None]
    for lay in failed:
        assert lay.failure is not None
        _say_invalid(lay.title, lay.failure.message)
    return 1 if failed else 0


def _draw(args: argparse.Namespace, fmt: str, target: Layout | Comparison) -> None:
    if fmt == "text":
        _write(args, render_text(target, width=_width(args), color=_color(args)))
    elif fmt == "svg":
        _write(args, render_svg(target))
    else:
        try:
            _write(args, render_png(target))
        except RuntimeError as exc:  # no Pillow
            raise UsageError(str(exc)) from None


def _predicted(loaded: Sequence[Schedule | Timeline], sources: Sequence[str],
               args: argparse.Namespace, fmt: str, comparing: bool) -> int:
    """`--predicted`: the measured timeline above its prediction (or the prediction as JSON)."""
    measured = loaded[0]
    if comparing or not isinstance(measured, Timeline) or measured.unit != "s":
        raise UsageError(f"--predicted takes one measured timeline (a .json a run wrote), not "
                          f"{' '.join(sources)}")
    if fmt not in ("text", "svg", "png", "json"):
        raise UsageError(f"--predicted draws text, svg or png (or writes json), not {fmt}")
    try:
        target = over_predicted(measured)
    except (ScheduleError, ValueError) as exc:
        raise UsageError(f"{sources[0]}: cannot predict it: {exc}") from None
    guess = target.layouts[1].timeline
    if fmt == "json" and guess is not None:
        _write(args, guess.to_json() + "\n")
    else:
        _draw(args, fmt, target)
    return 0


def _say_invalid(name: str, message: str) -> None:
    first, *rest = [line.strip() for line in message.splitlines()] or ["invalid"]
    text = " ".join([first, "; ".join(rest)]).strip()
    print(f"pipeviz: {name} is not a valid schedule: {text}", file=sys.stderr)


def _compare_subtitle(loaded: Sequence[Schedule | Timeline], costs: Costs) -> str | None:
    plans = [s for s in loaded if isinstance(s, Schedule)]
    if len(plans) != len(loaded):
        return None
    ranks = sorted({s.num_ranks for s in plans})
    mbs = sorted({s.num_microbatches for s in plans})
    return (f"{'/'.join(map(str, ranks))} ranks, {'/'.join(map(str, mbs))} micro-batches; "
            f"costs per rank {format_costs(costs)} (a rank's v stages take 1/v each); planned")


def _dot(source: Schedule | Timeline, args: argparse.Namespace, costs: Costs) -> int:
    if isinstance(source, Timeline):
        raise UsageError("--format dot draws a schedule's dependencies: give a schedule name "
                          "or a CSV, not a timeline")
    try:
        text = render_dot(source, costs=costs, max_nodes=args.max_nodes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.output) if args.output else None
    # -o graph.svg (or .png, .pdf) asks for a picture; any other name gets the DOT source.
    image_format = out.suffix.lower()[1:] if out and out.suffix.lower() in _DOT_IMAGES else None
    image = dot_to_image(text, image_format) if image_format else None
    if image is not None:
        _write(args, image)
    else:
        if out is not None and image_format:
            out = out.with_suffix(".dot")
        _write(args, text, path=out)
        if shutil.which("dot") is None or image_format:
            # The names of the files written and asked for (graph.* only for stdout).
            where = str(out) if out else "graph.dot"
            picture = (str(Path(args.output)) if image_format else
                       str(Path(where).with_suffix(".svg")))
            to = f" to {where}" if out else ""
            print(f"pipeviz: wrote DOT source{to}; graphviz's dot program (or the graphviz "
                  f"Python package) is missing; install it (apt-get install graphviz; pip "
                  f"install graphviz) and render with: dot -T{image_format or 'svg'} {where} "
                  f"-o {picture}", file=sys.stderr)
    failure = layout(source, costs=costs).failure
    if failure is not None:
        _say_invalid(source.name, failure.message)
        return 1
    return 0


def _width(args: argparse.Namespace) -> int:
    if args.width:
        width = int(args.width)
    elif args.output:
        width = 100
    else:
        width = shutil.get_terminal_size((100, 24)).columns
    if width < 40:
        raise UsageError(f"--width must be at least 40 columns (got {width})")
    return width


def _color(args: argparse.Namespace) -> bool:
    if args.color != "auto":
        return bool(args.color == "always")
    if args.output or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return sys.stdout.isatty()


def _write(args: argparse.Namespace, content: str | bytes, *, path: Path | None = None) -> None:
    target = path or (Path(args.output) if args.output else None)
    if target is None:
        assert isinstance(content, str)
        sys.stdout.write(content)
        sys.stdout.flush()
        return
    try:
        write_atomic(target, content)
    except FileRefused as exc:
        raise UsageError(f"cannot write {target}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
