"""The peer: torch.distributed.pipelining on the same layers, partition, ranks and micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.runtime.saved_bytes import SavedBytes
from pipeline.splitting.partition import bounds

__all__ = ["TORCH_PEERS", "TorchPipeline", "peer_stages", "unsupported"]

# Our schedule -> torch's schedule class. Torch's zero-bubble for one stage per rank is its
# interleaved ZB1P with a single local stage; its V-shape schedules hold two stages per rank.
TORCH_PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipe-v": "ScheduleDualPipeV",
}
_ROUNDS = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")  # m in rounds of p
_V = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # rank r: stages r and 2p - 1 - r, always


def unsupported(schedule: str, num_ranks: int, num_microbatches: int) -> str | None:
    """Why torch cannot run `schedule` here (None: it can); the rules torch 2.13's
    constructors check."""
    peer = TORCH_PEERS.get(schedule)
    if peer is None:
        return f"torch.distributed.pipelining has no {schedule} schedule"
    m, p = num_microbatches, num_ranks
    if peer == "Schedule1F1B" and m < p:
        return f"Schedule1F1B needs micro-batches >= ranks (m={m} < p={p})"
    if peer in _ROUNDS:
        rounds = max(1, m // p)
        if m % rounds:
            return f"{peer} needs micro-batches divisible by max(1, m // p) = {rounds} (m={m})"
    if peer == "ScheduleDualPipeV" and m < 2 * p:
        return (f"ScheduleDualPipeV needs micro-batches >= stages = 2 x ranks "
                f"(m={m} < {2 * p})")
    return None


def peer_stages(peer: str, rank: int, num_ranks: int, num_stages: int) -> list[int]:
    """The stages `rank` holds under torch's schedule class `peer`: r and 2p - 1 - r for the
    V-shape classes (torch fixes that placement), else r, r + p, ... (our loop placement)."""
    if peer in _V:
        return [rank, 2 * num_ranks - 1 - rank]
    return list(range(rank, num_stages, num_ranks))


class TorchPipeline:
    """This rank's stages (`peer_stages`: the placement our schedule uses too) and torch's
    schedule.

    The stages wrap the model's own layers (no copy): every variant of a measurement computes
    with the same parameters, so the comparison is not skewed by where the weights sit.
    `stage_module` wraps each stage's layers for torch (default: the nn.Sequential itself),
    e.g. to take a tuple output as the next stage's positional inputs.
    """

    def __init__(self, model: nn.Sequential, balance: Sequence[int], *, schedule: str,
                 rank: int, num_ranks: int, num_microbatches: int,
                 loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device,
                 group: Any = None,
                 stage_module: Callable[[nn.Sequential], nn.Module] = lambda s: s) -> None:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage

        reason = unsupported(schedule, num_ranks, num_microbatches)
        if reason is not None:
            raise ValueError(reason)
        self.name = TORCH_PEERS[schedule]
        layers = list(model)
        edges = bounds(balance)
        num_stages = len(balance)
        self.stages = [
            PipelineStage(stage_module(nn.Sequential(*layers[edges[s]:edges[s + 1]])), s,
                          num_stages, device, group=group)
            for s in peer_stages(self.name, rank, num_ranks, num_stages)
        ]
        self.first = any(stage.stage_index == 0 for stage in self.stages)
        self.last = any(stage.stage_index == num_stages - 1 for stage in self.stages)
        cls = getattr(pipelining.schedules, self.name)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        stage_arg: Any = self.stages if multi else self.stages[0]
        self.schedule = cls(stage_arg, n_microbatches=num_microbatches, loss_fn=loss_fn)

    def step(self, x: Any, target: Any) -> None:
        """One training step; only the first stage's rank feeds x, only the last's the target."""
        args = (x,) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=target)
        else:
            self.schedule.step(*args)

    def memory_step(self, x: Any, target: Any) -> dict[str, list[int]]:
        """One more step (not timed: the counting costs), and this rank's peak stash as our
        Pipe counts its own with `track_memory=True`: the most micro-batches alive at once (from
        a stage's forward until its backward completes: B, or W when split) and the most bytes
        they hold (each stage input plus what autograd saved in its forward, parameters not
        counted)."""
        counter = _StashCounter()
        for stage in self.stages:
            counter.watch(stage)
        try:
            self.step(x, target)
        finally:
            for stage in self.stages:  # the class's methods again
                for name in _StashCounter.WRAPPED:
                    vars(stage).pop(name, None)
        return {"peak_stashed_bytes": [counter.peak_bytes],
                "peak_stashed_microbatches": [counter.peak],
                "peak_activation_bytes": [counter.peak_activation_bytes]}


class _StashCounter:
    """Counts the micro-batches a rank's torch stages hold, by wrapping each stage's forward
    and backward calls (on the instance: torch's schedules call them through the stage)."""

    WRAPPED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self) -> None:
        self.alive: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> bytes
        self.held: dict[tuple[int, int], int] = {}  # the same, with the outputs kept
        self.peak = self.peak_bytes = self.peak_activation_bytes = 0

    def watch(self, stage: Any) -> None:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            with SavedBytes() as saved:
                out = forward(chunk, *args, **kwargs)
            outputs, inputs = stage.fwd_cache[chunk]
            stashed = saved.bytes + sum(
                t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
            # The stage keeps its outputs (in fwd_cache) until their backward.
            held = sum(t.numel() * t.element_size() for t in outputs
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None)
            self.alive[(stage.stage_index, chunk)] = stashed
            self.held[(stage.stage_index, chunk)] = stashed + held
            self.peak = max(self.peak, len(self.alive))
            self.peak_bytes = max(self.peak_bytes, sum(self.alive.values()))
            self.peak_activation_bytes = max(self.peak_activation_bytes,
                                             sum(self.held.values()))
            return out

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            out = backward(chunk, *args, **kwargs)
            if kwargs.get("full_backward", True):
                del self.alive[(stage.stage_index, chunk)], self.held[(stage.stage_index, chunk)]
            return out

        def backward_weight_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            out = weight(chunk, *args, **kwargs)
            del self.alive[(stage.stage_index, chunk)], self.held[(stage.stage_index, chunk)]
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
