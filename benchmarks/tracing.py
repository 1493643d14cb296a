"""A model split from its graph against the same layers flattened by hand: tracing time and step.

    python -m benchmarks.tracing --out benchmarks/results/tracing

A Llama-style model (Hugging Face `LlamaForCausalLM` from a random config: 16 layers, small
width) is split into 2 and 4 stages two ways: by `pipeline.split` at `model.layers.k` (export
in train and eval mode, then the cut), and by hand into an `nn.Sequential` (embedding and
rotary tables; decoder layers handing (hidden, cos, sin) on; norm and head) over the same
module objects. Both run under the same Pipe settings (threads, one per stage, 1f1b), their
steps taken in turn, round after round, in one run: the report gives the median per-step ratio
traced / eager over the rounds, the tracing time (the first split, which pays export's
warm-up, and the median of the next ones), and the two losses (equal: the same weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import pipeline
from benchmarks.env import environment
from pipeline import Pipe
from schedules.files import write_atomic

__all__ = ["flatten_llama", "main", "measure", "report"]


class _Embed(nn.Module):
    """Token embedding, the rotary tables every layer reads, and (`mask=True`) the causal mask
    as a (rows, 1, T, T) bool tensor, as the model builds it when traced; without it the
    layers' attention is causal by `is_causal`, as the model runs eagerly."""

    def __init__(self, model: Any, mask: bool) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens
        self.rotary_emb = model.model.rotary_emb
        self.mask = mask

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = self.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, positions)
        if not self.mask:
            return hidden, cos, sin
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        return hidden, cos, sin, causal[None, None].expand(ids.shape[0], 1, t, t)


class _Layer(nn.Module):
    """One decoder layer, handing the rotary tables (and the mask) on."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, cos, sin, *mask = values
        out = self.layer(hidden, attention_mask=mask[0] if mask else None,
                         position_embeddings=(cos, sin))
        return (out[0] if isinstance(out, tuple) else out, cos, sin, *mask)


class _Head(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.norm = model.model.norm
        self.lm_head = model.lm_head

    def forward(self, values: tuple[torch.Tensor, ...]) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(values[0]))
        return logits


def flatten_llama(model: Any, *, mask: bool) -> nn.Sequential:
    """The model's modules as an nn.Sequential: embedding, each layer, norm and head."""
    return nn.Sequential(_Embed(model, mask), *(_Layer(layer) for layer in model.model.layers),
                         _Head(model))


def _model(layers: int, hidden: int, vocab: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq, attention_dropout=0.0))


def _logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _output_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return _logits_loss(out.logits, target)


def _time(run: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps


def measure(*, layers: int, hidden: int, vocab: int, seq: int, rows: int, stages: int,
            chunks: int, rounds: int, steps: int, splits: int) -> dict[str, Any]:
    """One stage count: tracing times, and the two Pipes' steps taken in turn."""
    model = _model(layers, hidden, vocab, seq)
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "use_cache": False}
    per = layers // stages
    points = [f"model.layers.{k * per}" for k in range(1, stages)]
    trace_s = []
    split = None
    for _ in range(splits):
        start = time.perf_counter()
        split = pipeline.split(model, inputs, split_points=points)
        trace_s.append(time.perf_counter() - start)
    assert split is not None
    devices = ["cpu"] * stages
    balance = [1 + per] + [per] * (stages - 2) + [per + 1] if stages > 1 else [layers + 2]
    pipes = {"traced": Pipe(split, devices=devices, chunks=chunks, schedule="1f1b")}
    for name, mask in (("masked", True), ("causal", False)):
        pipes[name] = Pipe(flatten_llama(model, mask=mask), balance=balance, devices=devices,
                           chunks=chunks, schedule="1f1b")
    losses: dict[str, float] = {}

    def run(name: str) -> None:
        model.zero_grad(set_to_none=True)
        if name == "traced":
            losses[name] = pipes[name].step(inputs, ids, _output_loss).item()
        else:
            losses[name] = pipes[name].step(ids, ids, _logits_loss).item()

    for name in pipes:
        run(name)  # warm-up, one each
    samples = []
    for r in range(rounds):  # in turn, the order rotating: drift hits all alike
        names = list(pipes)[r % 3:] + list(pipes)[:r % 3]
        took = {name: _time(lambda name=name: run(name), steps) for name in names}
        samples.append({**{f"{k}_s": v for k, v in took.items()},
                        "ratio": took["traced"] / took["masked"],
                        "ratio_causal": took["traced"] / took["causal"]})
    for pipe in pipes.values():
        pipe.close()
    ratios = sorted(s["ratio"] for s in samples)
    return {
        "stages": stages, "split_points": points, "layers": layers, "hidden": hidden,
        "seq": seq, "rows": rows, "chunks": chunks,
        "trace_first_s": trace_s[0],
        "trace_median_s": statistics.median(trace_s[1:] or trace_s),
        "traced_step_s": statistics.median(s["traced_s"] for s in samples),
        "eager_step_s": statistics.median(s["masked_s"] for s in samples),
        "causal_step_s": statistics.median(s["causal_s"] for s in samples),
        "ratio_median": statistics.median(ratios), "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "ratio_causal_median": statistics.median(s["ratio_causal"] for s in samples),
        "samples": samples, "loss_traced": losses["traced"], "loss_eager": losses["masked"],
        "loss_causal": losses["causal"],
    }


def report(records: Sequence[dict[str, Any]], command: str = "") -> str:
    """The markdown report of `records`."""
    lines = ["# Split from the graph against flattened by hand", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += ["| stages | tracing, first (s) | tracing, median (s) | traced step (ms) | "
              "eager step, same mask (ms) | traced / eager, median [min, max] | losses | "
              "eager step, is_causal (ms) | traced / is_causal |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        same = "equal" if r["loss_traced"] == r["loss_eager"] else (
            f"{r['loss_traced']:.6f} vs {r['loss_eager']:.6f}")
        lines.append(
            f"| {r['stages']} | {r['trace_first_s']:.2f} | {r['trace_median_s']:.2f} | "
            f"{1e3 * r['traced_step_s']:.1f} | {1e3 * r['eager_step_s']:.1f} | "
            f"{r['ratio_median']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] | {same} | "
            f"{1e3 * r['causal_step_s']:.1f} | {r['ratio_causal_median']:.3f} |")
    first = records[0] if records else None
    if first is not None:
        lines += ["", f"Llama-style model: {first['layers']} layers, hidden {first['hidden']}, "
                      f"sequence {first['seq']}, {first['rows']} rows in {first['chunks']} "
                      f"micro-batches; threads, one per stage, 1f1b; one torch thread. "
                      f"Traced, the model attends through an explicit causal mask (Hugging "
                      f"Face builds one when it is traced): the eager Sequential does the same "
                      f"for the first ratio (the same aten ops), and attends with `is_causal` "
                      f"(the model's eager path) for the last."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tracing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per Pipe per round")
    parser.add_argument("--splits", type=int, default=3, help="times the split is timed")
    parser.add_argument("--out", type=Path, default=Path("bench-out/tracing"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the other suites: one intra-op thread per rank
    records = [measure(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq,
                       rows=args.rows, stages=int(s), chunks=args.chunks, rounds=args.rounds,
                       steps=args.steps, splits=args.splits)
               for s in args.stages.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.tracing " + " ".join(
        sys.argv[1:] if argv is None else argv)
    write_atomic(args.out / "results.json", json.dumps(
        {"environment": environment("cpu"), "records": records}, indent=1))
    write_atomic(args.out / "report.md", report(records, command.strip()))
    print(report(records, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
