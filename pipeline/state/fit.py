"""Whether a checkpoint fits this model, agreed by every rank: each rank's misfits are gathered
so that all raise alike, and none is left waiting in DCP's collectives for a rank that gave up."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipeline.errors import PipeConfigError, PipelineError
from pipeline.state import save_dirs
from pipeline.state.opened import Opened

__all__ = [
    "MODEL",
    "OPTIM",
    "agree",
    "everyone",
    "few",
    "foreign_parameters",
    "gather",
    "misfits",
    "problem_lines",
    "raise_unless_fits",
    "reason",
    "stranded",
]

MODEL, OPTIM = "model", "optim"  # the top-level keys of a checkpoint's state

Path = str | os.PathLike[str]


def misfits(own: dict[str, Any], saved: Metadata, prefix: str) -> list[str]:
    """This rank's keys (model or optimizer) the checkpoint lacks or holds with another shape."""
    entries = saved.state_dict_metadata
    what = "model" if prefix == MODEL else "optimizer"
    missing = sorted(k for k in own if f"{prefix}.{k}" not in entries)
    shapes = []
    for k, v in own.items():
        entry = entries.get(f"{prefix}.{k}")
        if isinstance(v, torch.Tensor) and entry is not None and (
                not isinstance(entry, TensorStorageMetadata) or entry.size != v.shape):
            seen = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "no tensor"
            shapes.append(f"{k!r}: checkpoint {seen}, here {tuple(v.shape)}")
    return ([f"{what} keys missing {few(missing)}"] if missing else []) + (
        [f"{what} shape mismatches " + few(shapes, "; ")] if shapes else [])


def stranded(template: dict[str, Any], saved: Metadata, module: nn.Module) -> list[str]:
    """Saved optimizer state of this rank's parameters that the optimizer has no slot for
    (another kind or options; or no state yet: torch creates it by a zero-gradient step,
    which it skips while gradients exist)."""
    names = {n for n, _ in module.named_parameters()}
    head = f"{OPTIM}.state."
    stranded = []
    for key in saved.state_dict_metadata:
        if not key.startswith(head):
            continue
        rest = key[len(head):]  # "<parameter name>.<state name>"
        mine = any(rest[:i] in names for i, c in enumerate(rest) if c == ".")
        if mine and f"state.{rest}" not in template:
            stranded.append(f"state.{rest}")
    if stranded:
        more = f" and {len(stranded) - 4} more" if len(stranded) > 4 else ""
        return [f"the optimizer has no slot for the saved {sorted(stranded)[:4]}{more}: use the "
                f"same kind and options; if it holds gradients but no state yet, call "
                f"optimizer.zero_grad(set_to_none=True) first"]
    return []


def foreign_parameters(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The optimizer must step the module's own parameters (so each has a name)."""
    if optimizer is None:
        return []
    mine = {id(p) for p in module.parameters()}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:
        return [f"the optimizer holds {foreign} parameter(s) that are not the module's: build "
                f"it on pipe.parameters() (multi-process: this rank's parameters only)"]
    return []


def everyone(problems: list[str], keys: set[str], group: Any, distributed: bool
              ) -> list[tuple[int, list[str], set[str]]]:
    """Every rank's (rank, problems, keys): all ranks then raise together, so none is left
    waiting in DCP's collectives for a rank that gave up."""
    if not distributed:
        return [(0, problems, keys)]
    return gather((dist.get_rank(group), problems, keys), group, distributed)


def gather(item: Any, group: Any, distributed: bool) -> list[Any]:
    """Every rank's `item`, in rank order (just this one's, in one process)."""
    if not distributed:
        return [item]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, item, group=group)
    return gathered


def agree(what: str, problems: list[str], group: Any, distributed: bool, *,
           cleanup: save_dirs.Staged | None = None) -> None:
    """Raise `PipelineError` on every rank alike if any rank has a problem, or if a rank does
    not answer (it died: the exchange fails rather than waits); first remove `cleanup`."""
    try:
        lines = problem_lines(everyone(problems, set(), group, distributed))
    except Exception as exc:  # a rank died or hung up: its peers fail here, none waits
        lines = [f"a rank did not answer ({type(exc).__name__}: {exc})"]
    if lines:
        if cleanup is not None:
            save_dirs.discard(cleanup)
        raise PipelineError(f"{what}: " + "; ".join(lines))


def raise_unless_fits(path: Path, opened: Opened | None,
                      everyone: list[tuple[int, list[str], set[str]]],
                      describe: Callable[[], str]) -> None:
    """Raise (on every rank alike) for any rank's problem, or model keys no rank has."""
    lines = problem_lines(everyone)
    if opened is None:  # this rank has said so among its problems
        raise PipeConfigError(f"load: nothing to load at {os.fspath(path)!r}: " + "; ".join(lines))
    union = {f"{MODEL}.{k}" for _, _, keys in everyone for k in keys}
    unexpected = sorted(k[len(MODEL) + 1:] for k in opened.metadata.state_dict_metadata
                        if k.startswith(MODEL + ".") and k not in union)
    if unexpected:
        lines.append(f"model keys unexpected {few(unexpected)} (no layer here has them)")
    if lines:
        raise PipeConfigError(
            f"load: {describe()} does not fit this model: " + "; ".join(lines)
            + ". Load a checkpoint of the same model (balance, number of ranks, threads or "
            "processes may differ)")


def few(items: list[str], sep: str | None = None, shown: int = 4) -> str:
    """The first `shown` of `items` (a list's text, or joined by `sep`) and how many more: a
    checkpoint of 200,000 unexpected keys is named in a line, not in megabytes."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    head = items[:shown]
    return (str(head) if sep is None else sep.join(head)) + more


def reason(exc: BaseException) -> str:
    """An exception in one line per rank (DCP's own carries every failed rank's traceback)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {reason(e)}" for r, (e, _) in sorted(exc.failures.items()))
    text = str(exc).strip()
    # torch's weights_only refusal says what it refused on its last lines
    detail = next((line for line in reversed(text.splitlines()) if "GLOBAL" in line), "")
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}" + (
        f" ({detail.strip()})" if detail else "")


def problem_lines(everyone: list[tuple[int, list[str], set[str]]]) -> list[str]:
    many = len(everyone) > 1
    return [(f"rank {r}: " if many else "") + p for r, ps, _ in everyone for p in ps]

