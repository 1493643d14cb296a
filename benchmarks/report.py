"""The markdown report: the targets, met or missed by how much, and a table per model."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.planner.contention import MARK, footnote
from pipeline.planner.memory import format_bytes

__all__ = ["Target", "data_parallel_table", "evaluate_targets", "format_bytes", "format_ms",
           "render_data_parallel", "render_markdown", "results_table"]

Record = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One figure held against its goal; `value` None when it was not measured."""

    name: str
    value: float | None
    goal: float
    at_most: bool  # True: value <= goal passes; False: value >= goal passes
    unit: str = "x"  # "x" (a ratio) or "%" (a fraction shown in percent)
    contended: bool = False  # a figure it comes from was measured under contention

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.goal if self.at_most else self.value >= self.goal

    def _show(self, value: float) -> str:
        return f"{value:.1%}" if self.unit == "%" else f"{value:.3f}"

    @property
    def status(self) -> str:
        """"met", "not measured", or "missed by <amount> (<relative>)"."""
        if self.value is None:
            return "not measured"
        if self.met:
            return "met"
        gap = abs(self.value - self.goal)
        amount = f"{gap * 100:.1f} points" if self.unit == "%" else f"{gap:.3f}"
        return f"missed by {amount} ({gap / self.goal:.0%} of the goal)"

    def row(self) -> str:
        goal = ("<= " if self.at_most else ">= ") + self._show(self.goal)
        value = "-" if self.value is None else self._show(self.value)
        if self.contended:
            value += f" {MARK}"
        return f"| {self.name} | {goal} | {value} | {self.status} |"


def _find(records: Iterable[Record], **config: Any) -> Record | None:
    for r in records:
        if all(r["config"].get(k) == v for k, v in config.items()):
            return r
    return None


def _reference_model(records: Sequence[Record]) -> str | None:
    models = [r["config"]["model"] for r in records]
    return "mlp" if "mlp" in models else (models[0] if models else None)


def evaluate_targets(records: Sequence[Record], *, microbatches: Sequence[int] = (4, 8, 16)
                     ) -> list[Target]:
    """The issue's targets on the reference model (the MLP when it was run), processes
    transport, p=2 (p=1 for the overhead)."""
    model = _reference_model(records)
    if model is None:
        return []
    base = {"model": model, "transport": "processes"}

    def ratio(key: str, *cells: str, **config: Any) -> tuple[float | None, bool]:
        r = _find(records, **base, **config)
        return (None, False) if r is None else (r["ratios"].get(key), contended(r, *cells))

    out: list[Target] = []
    same: list[float] = []
    any_contended = False
    for s in ("gpipe", "1f1b"):
        for m in microbatches:
            value, flag = ratio("ours_over_torch", "ours", "torch", schedule=s, num_ranks=2,
                                num_microbatches=m)
            out.append(Target(f"ours / torch, {s}, p=2, m={m}", value, 1.0, True,
                              contended=flag))
            any_contended |= flag
            if value is not None:
                same.append(value)
    out.append(Target("ours / torch, median of the gpipe and 1f1b cells above",
                      statistics.median(same) if same else None, 0.90, True,
                      contended=any_contended))
    for m in microbatches:
        # 1F1B itself caps any implementation at m / (m + p - 1) of the bound.
        share, flag = ratio("efficiency_hardware_bound", "ours", "hardware_bound",
                            schedule="1f1b", num_ranks=2, num_microbatches=m)
        out.append(Target(f"share of 1F1B's cap (hardware bound x (m + 1) / m), p=2, m={m}",
                          None if share is None else share * (m + 1) / m, 0.90, False, "%",
                          contended=flag))
    for m in microbatches:
        zb = _find(records, **base, schedule="zb-h1", num_ranks=2, num_microbatches=m)
        ofb = _find(records, **base, schedule="1f1b", num_ranks=2, num_microbatches=m)
        value = (None if zb is None or ofb is None else
                 zb["step_time_s"]["median"] / ofb["step_time_s"]["median"])
        flag = any(contended(r, "ours") for r in (zb, ofb) if r is not None)
        out.append(Target(f"zb-h1 / 1f1b step time, p=2, m={m}", value, 1.0, True,
                          contended=flag))
    errors = [abs(r["simulator"]["error"]) for r in records if r["config"]["num_ranks"] > 1]
    out.append(Target("simulator median |error|, all runs with p >= 2",
                      statistics.median(errors) if errors else None, 0.10, True, "%"))
    for m in microbatches:
        value, flag = ratio("overhead_vs_plain_1_thread", "ours", "plain_1_thread",
                            schedule="1f1b", num_ranks=1, num_microbatches=m)
        out.append(Target(f"1-stage overhead (Pipe / plain, 1 thread), m={m}", value, 1.03,
                          True, contended=flag))
    return out


def format_ms(summary: dict[str, Any] | None, *, spread: bool = False) -> str:
    """A time summary in milliseconds: "12.3", or "12.3 (11.9-14.0)" with its spread."""
    if summary is None:
        return "-"
    text = f"{summary['median'] * 1e3:.1f}"
    if spread:
        text += f" ({summary['min'] * 1e3:.1f}-{summary['max'] * 1e3:.1f})"
    return text


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _per_rank_bytes(values: Sequence[int]) -> str:
    return " / ".join(format_bytes(v) for v in values) or "-"


def _message_wait(r: Record) -> str:
    wait = r["overhead_s"].get("message_wait")
    return "-" if wait is None else f"{wait['median'] * 1e6:.0f}"


def _activations(r: Record) -> str:
    ours = r.get("peak_activation_bytes") or []
    theirs = r["torch"].get("peak_activation_bytes") or []
    if not ours:
        return "-"
    return _per_rank_bytes(ours) + (f" ({_per_rank_bytes(theirs)})" if theirs else "")


def contended(r: Record, *cells: str) -> bool:
    """Whether any of the record's `cells` (ours, torch, plain_1_thread, plain_all_threads,
    hardware_bound) was measured under contention (pipeline/planner/contention.py)."""
    table = r.get("contention") or {}
    return any((table.get(c) or {}).get("contended", False) for c in cells)


def _flag(r: Record, *cells: str) -> str:
    return f" {MARK}" if contended(r, *cells) else ""


_COLUMNS: list[tuple[str, Callable[[Record], str]]] = [
    ("transport", lambda r: r["config"]["transport"]),
    ("p", lambda r: str(r["config"]["num_ranks"])),
    ("schedule", lambda r: r["config"]["schedule"]),
    ("m", lambda r: str(r["config"]["num_microbatches"])),
    ("step ms: median (min-max)", lambda r: format_ms(r["step_time_s"], spread=True)
     + _flag(r, "ours")),
    ("samples/s", lambda r: f"{r['samples_per_s']['median']:.0f}"),
    ("bubble", lambda r: f"{r['bubble_fraction']['median']:.0%}"),
    ("peak stash per rank", lambda r: _per_rank_bytes(r["peak_stashed_bytes"])),
    ("sim ms (error)", lambda r: f"{r['simulator']['predicted_step_s'] * 1e3:.1f} "
                                 f"({r['simulator']['error']:+.0%})"),
    ("msg wait µs", lambda r: _message_wait(r)),
    ("peak activations per rank (torch's)", lambda r: _activations(r)),
    ("torch ms", lambda r: format_ms(r["torch"]["step_time_s"]) + _flag(r, "torch")),
    ("torch peak stash", lambda r: _per_rank_bytes(r["torch"].get("peak_stashed_bytes") or [])),
    ("ours/torch", lambda r: _num(r["ratios"]["ours_over_torch"]) + _flag(r, "ours", "torch")),
    ("speedup vs 1 thread", lambda r: _num(r["ratios"]["speedup_vs_plain_1_thread"])
     + _flag(r, "ours", "plain_1_thread")),
    ("vs all threads", lambda r: _num(r["ratios"]["speedup_vs_plain_all_threads"])
     + _flag(r, "ours", "plain_all_threads")),
    ("eff. ideal", lambda r: _num(r["ratios"]["efficiency_ideal"], "{:.0%}")
     + _flag(r, "ours", "plain_1_thread")),
    ("eff. bound", lambda r: _num(r["ratios"]["efficiency_hardware_bound"], "{:.0%}")
     + _flag(r, "ours", "hardware_bound")),
]
_CELLS = ("ours", "torch", "plain_1_thread", "plain_all_threads", "hardware_bound")


def _order(r: Record) -> tuple[Any, ...]:
    c = r["config"]
    return (c["transport"] != "processes", c["num_ranks"], c["schedule"],
            c["num_microbatches"])


def results_table(records: Sequence[Record]) -> str:
    """One markdown row per record, in a stable order."""
    lines = ["| " + " | ".join(name for name, _ in _COLUMNS) + " |",
             "|" + "|".join("---" for _ in _COLUMNS) + "|"]
    for r in sorted(records, key=_order):
        lines.append("| " + " | ".join(cell(r) for _, cell in _COLUMNS) + " |")
    if any(contended(r, *_CELLS) for r in records):
        lines += ["", footnote()]
    return "\n".join(lines)


def _bound_ms(summary: dict[str, Any] | None) -> str:
    return "-" if summary is None else f"{summary['min'] * 1e3:.1f}"


def _baselines(records: Sequence[Record]) -> str:
    """Per micro-batch count: the plain model on 1 thread and on all, and the bound."""
    rows = {}
    for r in records:
        c = r["config"]
        key = (c["num_ranks"], c["num_microbatches"], tuple(c["balance"]), c["transport"])
        b = r["baselines"]
        rows[key] = (format_ms(b["plain_1_thread_s"]) + _flag(r, "plain_1_thread"),
                     format_ms(b["plain_all_threads_s"]) + _flag(r, "plain_all_threads"),
                     _bound_ms(b["hardware_bound_s"]) + _flag(r, "hardware_bound"))
    lines = ["| p | m | balance | transport | plain, 1 thread ms | plain, all threads ms | "
             "hardware bound ms (fastest round) |", "|---|---|---|---|---|---|---|"]
    for (p, m, balance, transport), cells in sorted(rows.items()):
        lines.append(f"| {p} | {m} | {list(balance)} | {transport} | " + " | ".join(cells) + " |")
    if any(contended(r, "plain_1_thread", "plain_all_threads", "hardware_bound")
           for r in records):
        lines += ["", footnote()]
    return "\n".join(lines)


def _environment(env: dict[str, Any]) -> list[str]:
    return ["## Environment", "",
            f"- torch {env.get('torch')}, Python {env.get('python')}, {env.get('platform')}",
            f"- CPU: {env.get('cpu')} ({env.get('num_cpus')} logical CPUs); GPU: "
            f"{', '.join(env.get('gpu') or []) or 'none'}; device {env.get('device')}, "
            f"backend {env.get('backend')}",
            f"- threads: {env.get('threads_per_rank')} per rank; the plain model on 1 and on "
            f"{env.get('plain_all_threads')}",
            f"- git commit: {env.get('git_commit')}", *_load(env), ""]


def _load(env: dict[str, Any]) -> list[str]:
    """The machine's load around the run and the CPU time it got (environment.json's
    `load`), and how many figures were measured under contention."""
    load = env.get("load")
    if not load:
        return []
    line = (f"- load: 1-minute load average {_num(load.get('load_before'), '{:.1f}')} before "
            f"the run, {_num(load.get('load_after'), '{:.1f}')} after, on {load.get('cores')} "
            f"cores; the run's processes used {_num(load.get('cpu_s'), '{:.1f}')} s of CPU "
            f"in {_num(load.get('wall_s'), '{:.1f}')} s")
    others = load.get("others_cpu_s")
    line += ("; other programs' CPU time unknown (no /proc/stat: figures judged by their CPU "
             "share and the load average)" if others is None else
             f"; other programs took {others:.1f} s of CPU meanwhile")
    flagged = load.get("contended_cells") or []
    if flagged:
        line += (f"; **{len(flagged)} configuration(s) measured under contention**, their "
                 f"figures marked {MARK}: not reliable, rerun on an idle machine")
    return [line]


def latency_targets(records: Sequence[Record]) -> list[Target]:
    """The latency suite's targets: ours / torch per schedule and m on the latency-bound model
    (`small`) and on the reference MLP, their medians, and peak activation bytes against
    torch's on the MLP (processes, p=2)."""
    out: list[Target] = []
    for model, median_goal in (("small", 0.85), ("mlp", 0.85)):
        cells = sorted((r for r in records if r["config"]["model"] == model
                        and r["config"]["transport"] == "processes"
                        and r["config"]["num_ranks"] == 2), key=_order)
        values = []
        for r in cells:
            c = r["config"]
            value = r["ratios"]["ours_over_torch"]
            out.append(Target(f"`{model}` ours / torch, {c['schedule']}, "
                              f"m={c['num_microbatches']}", value, 1.0, True))
            if value is not None:
                values.append(value)
        if cells:
            out.append(Target(f"`{model}` ours / torch, median of the cells above",
                              statistics.median(values) if values else None, median_goal,
                              True))
        if model == "mlp":
            for r in cells:
                ours = r.get("peak_activation_bytes") or []
                theirs = r["torch"].get("peak_activation_bytes") or []
                c = r["config"]
                value = (max(a / b for a, b in zip(ours, theirs, strict=True) if b)
                         if ours and theirs and len(ours) == len(theirs) else None)
                out.append(Target(f"`mlp` peak activations / torch's (worst rank), "
                                  f"{c['schedule']}, m={c['num_microbatches']}", value, 1.0,
                                  True))
    return out


def render_markdown(records: Sequence[Record], environment: dict[str, Any], *,
                    suite: str, command: str, failures: Sequence[str] = (),
                    notes: Sequence[str] = ()) -> str:
    """The whole report: environment, targets, then per model its results and baselines."""
    out = [f"# Benchmark results: suite `{suite}`", "", f"`{command}`", "",
           *_environment(environment)]
    if suite == "latency":
        targets = latency_targets(records)
        where = "On `small` (latency-bound) and `mlp` (the anchor), two processes on one host"
    else:
        targets = evaluate_targets(records)
        where = f"On `{_reference_model(records)}`, multi-process (gloo)"
    if targets:
        out += ["## Targets", "", f"{where}, ours and torch's "
                "steps taken in turn on the same processes.", "",
                "| target | goal | measured | status |", "|---|---|---|---|",
                *(t.row() for t in targets), "",
                *([footnote(), ""] if any(t.contended for t in targets) else [])]
    if failures:
        out += ["## Failures", "", *(f"- {f}" for f in failures), ""]
    if notes:
        out += ["## Not run here", "", *(f"- {n}" for n in notes), ""]
    for model in dict.fromkeys(r["config"]["model"] for r in records):
        for method in dict.fromkeys(r["config"]["balance_method"] for r in records
                                    if r["config"]["model"] == model):
            chosen = [r for r in records if r["config"]["model"] == model
                      and r["config"]["balance_method"] == method]
            balances = sorted({(r["config"]["schedule"], tuple(r["config"]["balance"]))
                               for r in chosen if r["config"]["num_ranks"] > 1})
            out += [f"## `{model}`, balance by {method}", ""]
            if balances:
                out += ["Partitions (p >= 2): " + ", ".join(
                    f"{s} {list(b)}" for s, b in balances), ""]
            out += [results_table(chosen), "", "Baselines:", "", _baselines(chosen), ""]
    return "\n".join(out)


def _hidden_cell(r: Record) -> str:
    dp = r["data_parallel"]
    if dp is None:
        return "-"
    return (f"{dp['hidden_share']['median']:.0%} (all-reduce "
            f"{format_ms(dp['allreduce_s'])} ms, exposed {format_ms(dp['exposed_s'])} ms)")


def data_parallel_table(records: Sequence[Record]) -> str:
    """One row per dp x pp configuration (records of `benchmarks.data_parallel`)."""
    lines = ["| dp x pp | what | step ms: median (min-max) | samples/s | peak stash per rank | "
             "parameters per rank | all-reduce hidden (median) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        c = r["config"]
        what = (f"Pipe {c['schedule']}, {c['chunks']} micro-batches per replica, balance "
                f"{c['balance']}" if c["kind"] == "pipe" else "DDP, whole model")
        if r["skipped"] is not None:
            lines.append(f"| {c['name']} | {what} | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {c['name']} | {what} | {format_ms(r['step_time_s'], spread=True)} | "
                     f"{r['samples_per_s']['median']:.0f} | "
                     f"{_per_rank_bytes(r['peak_stashed_bytes'])} | "
                     f"{_per_rank_bytes(r['param_bytes'])} | {_hidden_cell(r)} |")
    return "\n".join(lines)


def render_data_parallel(records: Sequence[Record], environment: dict[str, Any], *,
                         command: str, notes: Sequence[str] = ()) -> str:
    """The dp suite's report: environment, then one table of the configurations."""
    first = records[0]["config"] if records else {}
    out = ["# Benchmark results: suite `dp` (pipeline x data parallelism)", "",
           f"`{command}`", "", *_environment(environment)]
    if notes:
        out += ["## Not run here", "", *(f"- {n}" for n in notes), ""]
    out += [f"## `{first.get('model')}`, global batch {first.get('global_batch')}", "",
            "Ranks in global order (rank = dp rank x pp + pp rank). Peak stash: stage inputs "
            "plus what autograd saved, at the peak, from one more untimed step (DDP: its "
            "input and one forward's saved tensors, counted the same way). All-reduce hidden: "
            "per timed step, 1 - (exposed time summed over ranks) / (all-reduce time summed "
            "over ranks); the all-reduce and exposed times are the slowest rank's.", "",
            data_parallel_table(records), ""]
    return "\n".join(out)
