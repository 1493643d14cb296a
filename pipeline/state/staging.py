"""Checkpoint directories swapped in whole: written beside the target, marked complete, renamed.

A save of checkpoint directory `ckpt` never writes into `ckpt`. Every rank writes into the
staged sibling `ckpt.tmp-<token>` (one token per save, chosen by one rank); once every rank
has agreed that its writes succeeded, one rank marks the staged directory complete (a
`.complete` file, fsynced with the directory) and swaps it in with two renames:

    ckpt            -> ckpt.old-<token>      (skipped when there is no `ckpt` yet)
    ckpt.tmp-<token> -> ckpt                 (then the parent is fsynced)

and removes `ckpt.old-<token>` and any other `ckpt.tmp-*` / `ckpt.old-*` left by earlier saves
that died. POSIX cannot rename a directory onto a non-empty one, so `ckpt` is briefly missing
between the renames; the recovery rule covers that window: a load of `ckpt` reads `ckpt` when it
exists, and otherwise the newest staged sibling that carries `.complete` (tokens begin with the
time, so "newest" is the greatest token). A staged directory without `.complete` is never read.
So `ckpt` always resolves to the old checkpoint or the new one, each complete; renames must be
atomic on the filesystem (true of local POSIX filesystems; a shared one must provide it).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time

from schedules.files import fsync_directory, write_atomic

__all__ = ["MARKER", "clean", "mark_complete", "new_token", "resolve", "staged_path",
           "swap_in", "target_problem"]

MARKER = ".complete"
_PATTERN = r"\.(tmp|old)-([0-9a-f]{16}-[0-9a-f]{8})"
# What DCP's FileSystemWriter writes, and our marker: a directory holding only these (or
# nothing) is a checkpoint that a save may replace.
_CHECKPOINT_FILE = re.compile(r"(\.metadata|\.metadata\.tmp|__\d+\.metadata|.*\.distcp|"
                              + re.escape(MARKER) + ")")

Path = str | os.PathLike[str]


def new_token() -> str:
    """Nanoseconds since the epoch, then randomness: tokens sort by the time they were made."""
    return f"{time.time_ns():016x}-{secrets.token_hex(4)}"


def staged_path(path: Path, token: str, kind: str = "tmp") -> str:
    """The sibling `<path>.tmp-<token>` (or `.old-<token>`) of checkpoint directory `path`."""
    return f"{_normal(path)}.{kind}-{token}"


def target_problem(path: Path) -> str | None:
    """Why a save may not replace `path` (it holds something other than a checkpoint), or
    None: absent, or a directory holding nothing but a checkpoint's files."""
    target = _normal(path)
    if not os.path.lexists(target):
        return None
    if not os.path.isdir(target):
        return (f"{target!r} exists and is not a directory: save to a new path or a "
                f"checkpoint directory")
    others = sorted(n for n in os.listdir(target) if not _CHECKPOINT_FILE.fullmatch(n))
    if others:
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        return (f"{target!r} holds files that are not a checkpoint's ({others[:5]}{more}), and a "
                f"save replaces the whole directory: save to a new or empty directory, or "
                f"remove them")
    return None


def mark_complete(staged: Path, token: str) -> None:
    """Record that every rank wrote its part of `staged` (call after they agreed)."""
    fsync_directory(staged)  # the ranks' files are in it before the marker says so
    write_atomic(os.path.join(staged, MARKER), token + "\n")


def swap_in(staged: Path, path: Path, token: str) -> None:
    """Replace checkpoint directory `path` by the complete `staged` one, then remove the old
    one and what earlier, interrupted saves of `path` left."""
    target = _normal(path)
    parent = os.path.dirname(target)
    if os.path.lexists(target):
        os.rename(target, staged_path(target, token, "old"))
        fsync_directory(parent)
    os.rename(staged, target)
    fsync_directory(parent)
    clean(target)


def clean(path: Path) -> None:
    """Remove every `<path>.tmp-<token>` and `<path>.old-<token>` sibling (only names of
    exactly that form; call only once `path` holds a complete checkpoint)."""
    for name in _siblings(path):
        shutil.rmtree(os.path.join(os.path.dirname(_normal(path)), name), ignore_errors=True)


def resolve(path: Path) -> str:
    """The directory a load of `path` reads: `path` if it exists, else the newest complete
    staged sibling (a save died between its renames), else `path`."""
    target = _normal(path)
    if os.path.lexists(target):
        return target
    parent = os.path.dirname(target)
    complete = [os.path.join(parent, name) for name in _siblings(target, "tmp")
                if os.path.isfile(os.path.join(parent, name, MARKER))]
    return max(complete) if complete else target  # one prefix: the greatest token wins


def _siblings(path: Path, kind: str = "tmp|old") -> list[str]:
    target = _normal(path)
    pattern = re.compile(re.escape(os.path.basename(target)) + _PATTERN.replace("tmp|old", kind))
    try:
        names = os.listdir(os.path.dirname(target))
    except FileNotFoundError:
        return []
    return [n for n in names if pattern.fullmatch(n)]


def _normal(path: Path) -> str:
    """`path` absolute, without trailing separators (`ckpt/` has the sibling `ckpt.tmp-*`) and
    with symbolic links resolved (a link to a checkpoint keeps pointing at the new one)."""
    return os.path.realpath(path)
