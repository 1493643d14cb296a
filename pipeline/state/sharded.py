"""Sharded checkpoints with torch.distributed.checkpoint: each rank saves and loads its own keys."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipeline.errors import PipeConfigError
from pipeline.state import fit, save_dirs, shard_reader, staging
from pipeline.state.held_writer import HeldWriter
from pipeline.state.opened import ATTEMPTS, Opened, open_checkpoint
from schedules.files import fsync_directory

__all__ = ["load", "save"]

_FORMAT = 1  # version of the layout record saved beside the state
_AGREEMENT_ROUNDS = 3  # times the ranks open the checkpoint again if they opened different ones

# The optimizer's state flattened per parameter name ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"): every entry belongs to one parameter, so it follows that parameter
# to whichever rank holds it on load, whatever the balance or number of ranks.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LAYOUT = "pipeline"  # beside fit.MODEL and fit.OPTIM

Path = str | os.PathLike[str]


def save(module: nn.Module, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write `module.state_dict()` (the model's keys) and, if given, `optimizer`'s state keyed
    by parameter names, as a DCP checkpoint in the directory `path`.

    A Pipe over several processes: every rank calls it and writes only its own layers (one file
    per rank, plus the shared `.metadata`). A Pipe in one process or a plain module: one process
    calls it. An optimizer that has never stepped gets torch's initialising step (lr 0) first.

    `path` always holds a complete checkpoint, the old or the new, even if a rank dies or the
    power fails part-way: the ranks write into a staged sibling, agree that all succeeded, and
    one rank swaps it in by renaming (see `pipeline.state.staging`). `path`, if it exists, must hold
    nothing but a checkpoint's files; the new one takes its modes. One save of `path` at a time:
    a second one meanwhile raises `PipeConfigError` (loads meanwhile are safe).
    """
    group, distributed = _group(module)
    leader = not distributed or dist.get_rank(group) == 0
    with contextlib.ExitStack() as held:
        problems = fit.foreign_parameters(module, optimizer)
        parent = None
        if leader and not problems:  # its parent held, one save of `path` at a time
            try:
                parent = held.enter_context(save_dirs.held_parent(path))
                held.enter_context(staging.save_lock(path, parent.fd))
            except PipeConfigError as exc:
                problems.append(str(exc))
        problems += [p for p in [staging.target_problem(path)] if p is not None]
        lines = fit.problem_lines(fit.everyone(problems, set(), group, distributed))
        if lines:
            raise PipeConfigError(f"save: cannot save to {os.fspath(path)!r}: "
                                  + "; ".join(lines))
        begun, modes, staged = ("", "", 0), None, None
        if parent is not None:  # the staged directory exists, private, before any rank writes
            try:
                token = staging.new_token(path)
                modes = staging.modes_for(path)
                staged = save_dirs.prepare(parent, token)
                held.callback(staged.close)
                begun = (token, "", os.fstat(staged.fd).st_ino)
            except (OSError, PipeConfigError) as exc:
                begun = ("", fit.reason(exc), 0)
        token, error, inode = fit.gather(begun, group, distributed)[0]  # the first rank's
        if error:
            raise PipeConfigError(f"save: cannot save to {os.fspath(path)!r}: creating its "
                                  f"staged directory failed ({error})")
        staged = _join(path, (token, inode), staged, group, distributed, held)
        _write(module, path, optimizer, token, modes, group, distributed, staged)


def _join(path: Path, made: tuple[str, int], staged: save_dirs.Staged | None, group: Any,
          distributed: bool, held: contextlib.ExitStack) -> save_dirs.Staged:
    """The staged directory the first rank made (`made`: its token and inode), held by every
    rank (the first rank's is `staged`); every rank raises alike if one could not open it."""
    failed: list[str] = []
    if staged is None:
        try:
            staged = save_dirs.join(staging.staged_path(path, made[0]), made[1])
            held.callback(staged.close)
        except (OSError, PipeConfigError) as exc:
            failed = [f"opening the staged directory failed: {fit.reason(exc)}"]
    fit.agree(f"save: the checkpoint at {os.fspath(path)!r} is unchanged", failed, group,
              distributed, cleanup=staged if staged is not None and staged.parent else None)
    assert staged is not None  # agree raised otherwise
    return staged


def _write(module: nn.Module, path: Path, optimizer: torch.optim.Optimizer | None, token: str,
           modes: staging.Modes | None, group: Any, distributed: bool,
           staged: save_dirs.Staged) -> None:
    """Every rank writes into the held staged directory; the leader (it has `modes`) swaps it
    in."""
    state: dict[str, Any] = {fit.MODEL: dict(module.state_dict()),
                             _LAYOUT: json.dumps(_layout(module, optimizer))}
    if optimizer is not None:
        state[fit.OPTIM] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
    try:  # every rank's files fsynced (the writer's sync_files), and the directory holding them
        _run(dcp_save, state, group, distributed,
             storage_writer=HeldWriter(staged.fd, staged.shown))
        fsync_directory(staged.fd)
        failed = []
    except (Exception, CheckpointException) as exc:  # any rank's is every rank's, below
        failed = [f"writing failed: {fit.reason(exc)}"]
    fit.agree(f"save: the checkpoint at {os.fspath(path)!r} is unchanged", failed, group,
              distributed, cleanup=staged if modes is not None else None)
    swapped = []
    if modes is not None:
        try:
            save_dirs.mark_complete(staged, token)
            save_dirs.seal(staged, modes)
            save_dirs.swap_in(staged, token)
        except Exception as exc:  # reported to every rank: none is left waiting below
            swapped = [f"swapping {staged.shown!r} in failed: {fit.reason(exc)}"]
    fit.agree(f"save: swapping the new checkpoint in at {os.fspath(path)!r} failed (a load "
              f"finds the old checkpoint or the new one, complete)", swapped, group, distributed)


def load(module: nn.Module, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what `save` wrote into `module` (a Pipe with any balance, ranks, threads or
    processes, or a plain module) and, if given, `optimizer` (built on its parameters).

    Each rank reads only its own keys. A Pipe over several processes: every rank calls it. If
    the checkpoint does not fit, every rank raises `PipeConfigError` naming the missing,
    unexpected and wrong-shape keys, and nothing is loaded. The directory is not trusted: no
    pickle in it may run code, and a missing or unreadable `.metadata`, or a shard file missing
    or cut short, raises `PipeConfigError` naming it before anything is loaded (damage within
    a shard's length shows only while reading: the error comes then). If `path` is missing
    because a save died between its two renames, the complete staged checkpoint beside it is
    read (`pipeline.state.staging` has the rule). The checkpoint is opened once, its files held
    open before any is read (`pipeline.state.opened`): a save replacing it meanwhile leaves
    this load the checkpoint it opened, whole; every rank loads the same one.
    """
    group, distributed = _group(module)
    for _ in range(ATTEMPTS):
        problems = fit.foreign_parameters(module, optimizer)
        opened = _open_agreed(path, problems, group, distributed)
        try:
            _load_opened(module, path, optimizer, opened, problems, group, distributed)
            return
        except _ReplacedWhileRead:  # on every rank alike: DCP gathers every rank's failure
            continue
        finally:
            if opened is not None:
                opened.close()
    raise PipeConfigError(f"load: {os.fspath(path)!r} was replaced {ATTEMPTS} times while it "
                          f"was being read (saves in a tight loop?): load again")


class _ReplacedWhileRead(Exception):
    """A save replaced the checkpoint while DCP read it: read the new one from the start."""


def _load_opened(module: nn.Module, path: Path, optimizer: torch.optim.Optimizer | None,
                 opened: Opened | None, problems: list[str], group: Any,
                 distributed: bool) -> None:
    own = dict(module.state_dict())
    state: dict[str, Any] = {fit.MODEL: own}
    saved = opened.metadata if opened is not None else None
    if saved is not None:
        problems += fit.misfits(own, saved, fit.MODEL)
        if optimizer is not None and not problems:
            if not any(k.startswith(fit.OPTIM + ".") for k in saved.state_dict_metadata):
                problems.append("it holds no optimizer state (it was saved without "
                                "optimizer=): load without optimizer=, or save with one")
            else:
                state[fit.OPTIM] = get_optimizer_state_dict(module, optimizer, options=_OPTIONS)
                problems += fit.misfits(state[fit.OPTIM], saved, fit.OPTIM)
                problems += fit.stranded(state[fit.OPTIM], saved, module)
    fit.raise_unless_fits(path, opened, fit.everyone(problems, set(own), group, distributed),
                          lambda: _describe(path, opened))
    assert opened is not None  # raise_unless_fits raised otherwise
    if opened.path != staging.normal(path):
        warnings.warn(f"{os.fspath(path)!r} is missing (a save of it was cut short between its "
                      f"two renames): loading the complete new checkpoint {opened.path!r}; the "
                      f"next save of {os.fspath(path)!r} tidies up", stacklevel=3)
    try:
        _run(dcp_load, state, group, distributed, storage_reader=_reader(opened),
             planner=shard_reader.Planner())
    except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
        if _replaced(exc):
            raise _ReplacedWhileRead from exc
        raise PipeConfigError(f"load: {_describe(path, opened)} is damaged: reading it "
                              f"failed ({fit.reason(exc)}). Load another checkpoint, or save this "
                              f"one again") from exc
    module.load_state_dict(own)  # tensors were filled in place; this lets the module react
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state[fit.OPTIM], options=_OPTIONS)


def _reader(opened: Opened) -> shard_reader.Reader:
    return shard_reader.Reader(opened.path, opened.metadata, opened.directory, opened.held)


def _replaced(exc: BaseException) -> bool:
    """Whether DCP failed because a shard file vanished (a save replaced the directory), on
    any rank."""
    if isinstance(exc, CheckpointException):
        return any(_replaced(e) for e, _ in exc.failures.values())
    return isinstance(exc, shard_reader.Replaced)


def _open_agreed(path: Path, problems: list[str], group: Any, distributed: bool
                 ) -> Opened | None:
    """The checkpoint every rank opened, the same one (a save between two ranks' opens makes
    them open it again); None with the reason among `problems` if there is none to load."""
    for _ in range(_AGREEMENT_ROUNDS):
        found: list[str] = []
        opened = _open(path, found)
        seen = fit.gather(opened.identity if opened is not None else None, group, distributed)
        if len({s for s in seen if s is not None}) <= 1:
            problems += found
            return opened
        if opened is not None:
            opened.close()
    problems.append(f"the ranks opened different checkpoints {_AGREEMENT_ROUNDS} times (saves "
                    f"kept replacing it): load again")
    return None


def _group(module: nn.Module) -> tuple[Any, bool]:
    """(process group, True) for a Pipe running as one of several processes; else (None,
    False): DCP then runs without a process group, in this process alone."""
    if getattr(module, "mesh", None) is not None:  # every rank of the mesh: the default group
        return None, True
    if getattr(module, "world", None):
        return getattr(module, "group", None), True
    return None, False


def _run(call: Callable[..., Any], state: dict[str, Any], group: Any, distributed: bool,
         **storage: Any) -> None:
    """DCP's save or load with `storage` (its writer, or reader and planner): over the Pipe's
    process group, or in this process alone (DCP then warns that it assumes one process;
    that is intended here)."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        call(state, process_group=group, no_dist=not distributed, **storage)


def _layout(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    world = getattr(module, "world", None)
    balance = getattr(module, "balance", None)
    return {"format": _FORMAT, "module": type(module).__name__,
            "balance": list(balance) if balance is not None else None,
            "processes": world[1] if world else 1,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None}


def _describe(path: Path, opened: Opened | None) -> str:
    """What the checkpoint was saved from, in words (read from its layout record)."""
    where = f"the checkpoint at {os.fspath(path)!r}"
    if opened is None or _LAYOUT not in opened.metadata.state_dict_metadata:
        return where
    record: dict[str, Any] = {_LAYOUT: ""}
    try:
        _run(dcp_load, record, None, False, storage_reader=_reader(opened),
             planner=shard_reader.Planner())
        layout = json.loads(record[_LAYOUT])
        shape = (f" with balance {layout['balance']}" if layout["balance"] is not None else "")
        shape += f" over {layout['processes']} processes" if layout["processes"] > 1 else ""
        optimizer = layout["optimizer"] or "no optimizer"
        return f"{where} (saved from a {layout['module']}{shape}, {optimizer} state)"
    except (Exception, CheckpointException):  # damaged: the error being raised says so
        return where


def _open(path: Path, problems: list[str]) -> Opened | None:
    """The checkpoint a load of `path` reads, opened, if it and the shard files its metadata
    names are sound; else None, with what is wrong among `problems`."""
    try:
        opened = open_checkpoint(path)
    except (FileNotFoundError, NotADirectoryError):
        problems.append("there is no DCP checkpoint there (no .metadata file): save one with "
                        "pipeline.state.sharded.save(pipe, path)")
        return None
    except PipeConfigError as exc:  # it may not be read: the message says why and what to do
        problems.append(str(exc))
        return None
    except (OSError, ValueError) as exc:
        problems.append(f"{exc}: it is damaged or no DCP checkpoint; load another, or save it "
                        f"again")
        return None
    if opened.damage:
        more = f"; and {len(opened.damage) - 5} more" if len(opened.damage) > 5 else ""
        problems.append("; ".join(opened.damage[:5]) + more + ": the checkpoint is damaged (a "
                        "copy or a save cut short?); load another, or save it again")
        opened.close()
        return None
    return opened
