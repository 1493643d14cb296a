"""The planner's memory: its last choice per model and settings, one private file per key.

A plan's predicted steps move from run to run with the profile's noise (a few percent, more
under load), and a choice made afresh each run moves with them wherever two candidates lie
near the margin of `ties.NEAR`. So the planner remembers what it chose, keyed by what
determines the candidates (the model's structure, ranks, memory limit, threads, transport,
batch rows, the space searched and the library's version of it: not the profile's numbers),
and keeps it while no candidate is more than `ties.KEEP` faster than it re-predicted
(`ties.choose`).

The files live in `$PIPELINE_CACHE_DIR/plans`, else `$XDG_CACHE_HOME/pipeline/plans`, else
`~/.cache/pipeline/plans` (directories made 0700, files 0600), read and written through the
file gate (`schedules.files`): the file is opened from the held directory without following a
link, as a regular file of this user, at most `MAX_FILE_BYTES`. What it holds is never
trusted: one that is refused, damaged, of other settings or naming no candidate of this run
is ignored (a one-line `RecallWarning`) and the plan is chosen afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.errors import PipeTypeError
from pipeline.planner.costs import ModelProfile
from pipeline.planner.space import CHECKPOINTS, Candidate, Configuration
from pipeline.planner.ties import identity, named, recalled
from schedules import files

__all__ = ["ENV", "FORMAT", "MAX_FILE_BYTES", "SPACE_VERSION", "Memory", "Recall",
           "RecallWarning", "describe", "directory", "load", "memory_of"]

ENV = "PIPELINE_CACHE_DIR"
FORMAT = 1
# Raise it when the candidates or the rules that choose among them change: a choice made
# under other rules is then not kept.
SPACE_VERSION = 1
MAX_FILE_BYTES = 64 << 10  # a remembered choice is a few hundred bytes
_MAX_NAME = 200  # a schedule's name, an option's


class RecallWarning(UserWarning):
    """A file of remembered choices that was ignored (refused, damaged, of other settings) or
    could not be written; the plan is chosen afresh."""


def directory() -> Path:
    """Where the last choices live: `$PIPELINE_CACHE_DIR/plans`, else the XDG cache's
    `pipeline/plans` (`$XDG_CACHE_HOME`, when absolute, else `~/.cache`)."""
    mine = os.environ.get(ENV)
    if mine:
        return Path(mine) / "plans"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "pipeline" / "plans"


def describe(model: Any, sample: Any) -> tuple[str, ...]:
    """The model's structure as the key names it: each module's name and type, each
    parameter's name, shape and dtype, the sample's tensors' shapes and dtypes (other leaves
    by type and value), and torch's thread count (a profile's costs depend on it)."""
    import torch

    lines = [f"threads {torch.get_num_threads()}"]
    if isinstance(model, torch.nn.Module):
        lines += [f"module {name} {type(m).__module__}.{type(m).__qualname__}"
                  for name, m in model.named_modules()]
        lines += [f"param {name} {tuple(p.shape)} {p.dtype} {p.requires_grad}"
                  for name, p in model.named_parameters()]

    def leaves(value: Any, at: str) -> None:
        if isinstance(value, torch.Tensor):
            lines.append(f"sample{at} {tuple(value.shape)} {value.dtype} {value.device.type}")
        elif isinstance(value, Mapping):
            for k in sorted(value, key=str):
                leaves(value[k], f"{at}[{k!r}]")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                leaves(v, f"{at}[{i}]")
        else:
            lines.append(f"sample{at} {type(value).__qualname__} {str(value)[:_MAX_NAME]}")

    leaves(sample, "")
    return tuple(lines)


@dataclass(frozen=True)
class Recall:
    """What was read: the last choice (None when there is none or it was ignored), and why
    its file was ignored ('' when it was read, or there was none)."""

    last: Configuration | None = None
    ignored: str = ""


@dataclass(frozen=True)
class Memory:
    """The last choices in `directory`, for a model that `model` names beyond its profile's
    shape (`describe`'s lines; none for a profile in hand)."""

    directory: Path
    model: tuple[str, ...] = ()

    def key(self, profile: ModelProfile, settings: Mapping[str, Any]) -> str:
        """The digest of what determines the candidates: the library's version, the model,
        the profile's shape (layers, parameters, buffers, batch rows, device; not its times
        or activations) and `settings`."""
        parts = {"format": FORMAT, "space": SPACE_VERSION, "library": _version(),
                 "model": list(self.model),
                 "profile": [profile.num_layers, profile.params, profile.buffer_bytes,
                             profile.batch_rows, profile.device, sorted(profile.by_rows)],
                 "settings": dict(settings)}
        text = json.dumps(parts, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def read(self, key: str) -> Recall:
        """The last choice under `key` (a `RecallWarning` for a file ignored)."""
        return _read(self.directory, f"{key}.json", key)

    def write(self, key: str, chosen: Candidate) -> str:
        """Remember `chosen` under `key`; '' when done, else why not (also warned)."""
        shown = os.fspath(self.path(key))
        data = json.dumps({"format": FORMAT, "key": key, "choice": _as_json(chosen),
                           "predicted_step": chosen.step_time}, indent=1).encode()
        try:
            fd = files.open_directory(self.directory, create=True, private=True, mode=0o700)
            try:
                # The directory is ours and private; a link or other kind in it is still
                # not written through (the gate would follow a link of ours).
                name = f"{key}.json"
                try:
                    old: os.stat_result | None = os.stat(name, dir_fd=fd,
                                                         follow_symlinks=False)
                except FileNotFoundError:
                    old = None
                if old is not None and not stat.S_ISREG(old.st_mode):
                    raise files.FileRefused(f"{shown!r} is {files.walk.kind_of(old.st_mode)}, "
                                            f"not a regular file: not written through; remove "
                                            f"it")
                files.write_in(fd, name, data, shown, mode=0o600)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            why = _one_line(exc)
            warnings.warn(f"the planner's choice is not remembered: {why}", RecallWarning,
                          stacklevel=4)
            return why
        return ""

    def settle(self, key: str, recall: Recall, candidates: Sequence[Candidate]) -> str:
        """What the memory did for the search's `candidates` (the chosen first), remembering
        the choice when it is new: the line `Plan.summary` shows."""
        chosen = candidates[0]
        ms = "" if chosen.step_time is None else f", {chosen.step_time * 1e3:.2f} ms"
        if recall.last is not None:
            said = recalled(candidates, recall.last)
        elif recall.ignored:
            said = (f"the last choice's file was ignored ({recall.ignored}); chose "
                    f"{named(chosen)}{ms} afresh")
        else:
            said = f"no last choice for this model and settings: chose {named(chosen)}{ms}"
        if recall.last is not None and identity(recall.last) == identity(chosen):
            return said
        why = self.write(key, chosen)
        if why:
            return f"{said}; not remembered: {why}"
        return said if recall.last is not None or recall.ignored else \
            f"{said}; remembered in {_home(self.path(key))}"


def memory_of(remember: object, model: tuple[str, ...] = ()) -> Memory | None:
    """The memory `remember` asks for: None for False, the default directory for True, that
    directory for a path, itself for a `Memory`."""
    if isinstance(remember, Memory):
        return remember
    if remember is False:
        return None
    if remember is True:
        return Memory(directory(), model)
    if isinstance(remember, str | os.PathLike) and os.fspath(remember):
        return Memory(Path(remember), model)
    raise PipeTypeError(f"remember must be True (the last choice, kept in {directory()}), "
                        f"False (choose afresh) or a directory to keep it in (got "
                        f"{remember!r})")


def load(path: str | os.PathLike[str]) -> Configuration | None:
    """The choice remembered in file `path`, whatever its key; None (and a `RecallWarning`)
    if it may not be read or holds no choice."""
    where = Path(path)
    return _read(where.parent, where.name, None).last


def _read(where: Path, name: str, key: str | None) -> Recall:
    shown = os.fspath(where / name)
    try:
        fd = files.open_directory(where, private=True)
    except FileNotFoundError:
        return Recall()  # nothing remembered yet
    except (OSError, ValueError) as exc:
        return _ignored(shown, _one_line(exc))
    try:
        try:
            handle = files.open_in(fd, name, shown=shown)
        except FileNotFoundError:
            return Recall()
        try:
            owner = os.fstat(handle).st_uid
            if hasattr(os, "geteuid") and owner != os.geteuid():
                raise files.FileRefused(
                    f"{shown!r} belongs to another user (uid {owner}), not to you: a choice "
                    f"remembered for you is never theirs; remove it")
            data = files.read_bytes(handle, limit=MAX_FILE_BYTES, shown=shown)
        finally:
            os.close(handle)
        return Recall(_choice(files.parse_json(data, shown=shown, max_depth=4), key, shown))
    except (OSError, ValueError) as exc:
        return _ignored(shown, _one_line(exc))
    finally:
        os.close(fd)


def _ignored(shown: str, why: str) -> Recall:
    warnings.warn(f"the planner's last choice is ignored: {why}", RecallWarning, stacklevel=5)
    return Recall(None, why)


def _choice(data: Any, key: str | None, shown: str) -> Configuration:
    """The configuration `data` names, every field checked (ValueError naming it)."""
    if not isinstance(data, dict):
        raise ValueError(f"{shown!r} holds no object of a remembered choice")
    if data.get("format") != FORMAT:
        raise ValueError(f"{shown!r} is of format {data.get('format')!r}, not {FORMAT}")
    if key is not None and data.get("key") != key:
        raise ValueError(f"{shown!r} is for other settings (its key {data.get('key')!r}, not "
                         f"{key!r})")
    c = data.get("choice")
    if not isinstance(c, dict):
        raise ValueError(f"{shown!r} holds no choice object")
    whole = {}
    for name in ("dp", "pp", "tp", "chunks", "rows"):
        v = c.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{shown!r}: {name} must be a whole number >= 1 (got {v!r})")
        whole[name] = v
    schedule, checkpoint, options = c.get("schedule"), c.get("checkpoint"), c.get("options")
    if not isinstance(schedule, str) or not 0 < len(schedule) <= _MAX_NAME:
        raise ValueError(f"{shown!r}: schedule must be a name (got {schedule!r})")
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"{shown!r}: checkpoint must be one of {CHECKPOINTS} (got "
                         f"{checkpoint!r})")
    if not isinstance(options, list) or not all(
            isinstance(o, list) and len(o) == 2 and isinstance(o[0], str)
            and len(o[0]) <= _MAX_NAME and isinstance(o[1], int)
            and not isinstance(o[1], bool) for o in options):
        raise ValueError(f"{shown!r}: options must be [name, whole number] pairs (got "
                         f"{options!r})")
    return Configuration(schedule, tuple((k, v) for k, v in options), whole["dp"],
                         whole["pp"], whole["chunks"], whole["rows"], checkpoint,
                         tp=whole["tp"])


def _as_json(c: Configuration) -> dict[str, Any]:
    return {"schedule": c.schedule, "options": [list(o) for o in c.options], "dp": c.dp,
            "pp": c.pp, "tp": c.tp, "chunks": c.chunks, "rows": c.rows,
            "checkpoint": c.checkpoint}


def _version() -> str:
    try:
        return metadata.version("pipeline-engine")
    except metadata.PackageNotFoundError:  # run from a checkout
        return "checkout"


def _one_line(exc: BaseException) -> str:
    text = str(exc) if not isinstance(exc, OSError) or not exc.strerror else (
        f"{exc.filename!r}: {exc.strerror}" if exc.filename else exc.strerror)
    return " ".join(text.split())


def _home(path: Path) -> str:
    """`path` with the home directory as `~`."""
    home = os.path.expanduser("~")
    text = os.fspath(path)
    return "~" + text[len(home):] if home != "/" and text.startswith(home + os.sep) else text
