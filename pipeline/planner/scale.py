"""The scale check: GPT models planned on a simulated A100 cluster, beside Megatron-LM's runs.

    python -m pipeline.planner.scale            # every run below, the planner's free choice
    python -m pipeline.planner.scale --megatron # and Megatron's own configuration, and its
                                                # schedules with full recomputation

The same search that plans a profiled model plans an analytic one here
(`pipeline.planner.transformer`), on the hardware profile `A100_80GB`; docs/scale-check.md
sets the results beside what Narayanan et al. published and explains the differences.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.planner.hardware import A100_80GB, Hardware
from pipeline.planner.memory import checkpointed
from pipeline.planner.plan import plan_profile
from pipeline.planner.result import Plan
from pipeline.planner.search import predict
from pipeline.planner.space import Candidate
from pipeline.planner.transformer import GPT, MIXED_ADAM, gpt_profile

__all__ = ["HEADER", "MEGATRON_SCHEDULES", "MICROBATCH_ROWS", "PUBLISHED", "Published",
           "ScaleCheck", "check", "main", "megatron", "plan_run", "row"]

MICROBATCH_ROWS = (1, 2, 4, 8)
"""Micro-batch sizes (sequences) searched: Megatron's runs use 1 or 2 at these sizes, and
larger ones only shrink the number of micro-batches a pipeline fills its bubble with."""

MEGATRON_SCHEDULES = ("1f1b", "interleaved")
"""The schedules Narayanan et al. ran (PipeDream-Flush's 1F1B and their interleaved one)."""


@dataclass(frozen=True)
class Published:
    """A run Narayanan et al. (SC 2021) report: model, GPUs, global batch, per-GPU TFLOP/s as
    the paper counts them (its equation (3): every block's forward twice, as with the full
    recomputation the runs used), and t, p where the paper gives them (None where not)."""

    name: str
    model: GPT
    gpus: int
    batch: int
    tflops: float
    tp: int | None
    pp: int | None
    source: str


PUBLISHED = {
    "175B": Published("GPT-3 175B", GPT(96, 12288, 96), 1024, 1536, 140.0, None, None,
                      "section 5.1, under Table 1: 140 TFLOP/s per GPU on 1024 A100s at batch "
                      "1536, 34 days for 300B tokens; the run's t and p are not given"),
    "39B": Published("39.1B", GPT(48, 8192, 64), 512, 1536, 138.0, 8, 2, "Table 1"),
    "18B": Published("18.4B", GPT(40, 6144, 48), 256, 1024, 135.0, 8, 1, "Table 1"),
}


@dataclass(frozen=True)
class ScaleCheck:
    """A run planned or predicted: how (`label`), the configuration (a `Candidate`: shape,
    micro-batch rows, schedule, recomputation, predicted step and peak), the share of
    micro-batches recomputed, and per-GPU TFLOP/s: `executed`, the FLOPs the configuration
    runs, recomputation included (as the paper counts its own recomputing runs), and
    `model`, the model's FLOPs alone (72 B s l h^2 (1 + s/6h + V/12lh))."""

    run: Published
    label: str
    config: Candidate
    recomputed: float
    executed: float
    model: float

    @property
    def published_model(self) -> float:
        """The paper's figure in model FLOPs: its runs recomputed every block's forward."""
        m, b = self.run.model, self.run.batch
        return self.run.tflops * m.flops_per_step(b, 0.0) / m.flops_per_step(b, 1.0)


def _checked(run: Published, label: str, config: Candidate) -> ScaleCheck:
    assert config.step_time is not None
    share = sum(checkpointed(config.checkpoint, config.chunks)) / config.chunks
    per_gpu = config.step_time * run.gpus * 1e12
    return ScaleCheck(run, label, config, share,
                      run.model.flops_per_step(run.batch, share) / per_gpu,
                      run.model.flops_per_step(run.batch, 0.0) / per_gpu)


def plan_run(run: Published, hardware: Hardware = A100_80GB, *,
             schedules: Sequence[str] | None = None,
             checkpoints: Sequence[str] | None = None) -> Plan:
    """Plan `run` on `hardware`'s accelerators (their usable memory each, `per_host` to a
    host) with the analytic profile of its model and mixed-precision Adam."""
    profile, sharding = gpt_profile(run.model, hardware, batch=run.batch,
                                    rows=[b for b in MICROBATCH_ROWS if b <= run.batch])
    return plan_profile(profile, ranks=run.gpus, memory_per_rank=hardware.memory_budget,
                        link=hardware.network_link, host_link=hardware.host_link,
                        ranks_per_host=hardware.per_host, sharding=sharding,
                        microbatch_rows=MICROBATCH_ROWS, optimizer=MIXED_ADAM,
                        schedules=schedules, checkpoints=checkpoints, transport="nccl")


def check(run: Published, hardware: Hardware = A100_80GB, *,
          schedules: Sequence[str] | None = None,
          checkpoints: Sequence[str] | None = None) -> ScaleCheck:
    """`plan_run`, with the plan's throughput."""
    p = plan_run(run, hardware, schedules=schedules, checkpoints=checkpoints)
    label = "any schedule" if schedules is None else "Megatron's schedules"
    return _checked(run, label, p.chosen)


def megatron(run: Published, hardware: Hardware = A100_80GB, *, tp: int = 8,
             pp: int | None = None, microbatch: int = 1,
             stages_per_rank: int = 2) -> ScaleCheck:
    """The simulator's prediction for the configuration Megatron ran (`run.tp` x `run.pp`
    where published, else `tp` x `pp`): micro-batches of `microbatch` sequences, the
    interleaved schedule with `stages_per_rank` when pipelined, every micro-batch
    recomputed. What the paper does not give (micro-batch size, interleaving depth, and for
    GPT-3 t and p) are assumptions, named in the label."""
    t = run.tp if run.tp is not None else tp
    p = run.pp if run.pp is not None else pp
    if p is None or run.gpus % (t * p):
        raise ValueError(f"{run.name}: give pp so that tp x pp divides {run.gpus} GPUs")
    dp = run.gpus // (t * p)
    profile, sharding = gpt_profile(run.model, hardware, batch=run.batch, rows=[microbatch])
    schedule, options = (("interleaved", (("stages_per_rank", stages_per_rank),)) if p > 1
                         else ("1f1b", ()))
    config = predict(profile, hardware.network_link, schedule=schedule, options=options,
                     chunks=run.batch // dp // microbatch, checkpoint="always", dp=dp, pp=p,
                     tp=t, sharding=sharding, host_link=hardware.host_link,
                     ranks_per_host=hardware.per_host, optimizer=(MIXED_ADAM, 0))
    guessed = "t, p, " if run.tp is None else ""
    return _checked(run, f"Megatron's configuration ({guessed}micro-batch assumed)", config)


def row(c: ScaleCheck) -> str:
    """One markdown table row of a check."""
    k, r = c.config, c.run
    paper = f"{r.tp} x {r.pp}" if r.tp is not None else "not given"
    peak = max(k.peak_bytes or (0.0,)) / 2**30
    return (f"| {r.name} | {r.gpus} | {r.batch} | {c.label} | {k.dp} x {k.pp} x {k.tp} | "
            f"{paper} | {k.rows} | {k.label} | {k.checkpoint} | {k.step_time:.2f} | "
            f"{peak:.1f} | {c.executed:.0f} | {r.tflops:.0f} | {c.model:.0f} | "
            f"{c.published_model:.0f} |")


HEADER = ("| model | GPUs | batch | configuration | dp x pp x tp | paper's tp x pp | micro-batch "
          "| schedule | recompute | step s | peak GiB | TFLOP/s per GPU, executed | paper | "
          "model TFLOP/s | paper, model |\n" + "|---" * 15 + "|")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.planner.scale", description=(
        "Plan GPT models on a simulated A100 cluster and print them beside Megatron-LM's "
        "published runs."))
    parser.add_argument("runs", nargs="*",
                        help=f"which runs (default: all of {', '.join(PUBLISHED)})")
    parser.add_argument("--megatron", action="store_true",
                        help="also predict Megatron's own configuration, and plan with its "
                             "schedules and full recomputation only")
    args = parser.parse_args(argv)
    unknown = [r for r in args.runs if r not in PUBLISHED]
    if unknown:
        parser.error(f"unknown runs {unknown}: choose from {', '.join(PUBLISHED)}")
    print(f"hardware: {A100_80GB.name}")
    print(HEADER)
    for name in args.runs or list(PUBLISHED):
        run = PUBLISHED[name]
        print(row(check(run)), flush=True)
        if args.megatron:
            print(row(megatron(run, pp=16)), flush=True)
            print(row(check(run, schedules=MEGATRON_SCHEDULES, checkpoints=["always"])),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
