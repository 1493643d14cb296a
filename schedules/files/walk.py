"""The file gate's walk: paths opened one component at a time by its rules, and bounded reads."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import stat
from typing import Any

__all__ = ["FileRefused", "held_directory", "kind_of", "open_directory", "open_file", "open_in",
           "parse_json", "read_bytes", "read_file", "read_json", "refuse_planted", "resolve",
           "shared"]

Path = str | os.PathLike[str]

_MAX_LINKS = 40  # links met in one walk, as the kernel's ELOOP limit
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFLNK: "a symbolic link"}


class FileRefused(ValueError):
    """A file the gate will not read or write; the message names the path, the rule and the
    way out."""


def shared(info: os.stat_result) -> bool:
    """Whether users other than a directory's owner may create or rename entries in it: it is
    writable by others, or by a group that is not the owner's own. Most distributions give
    each user a group of their own (its name theirs, their primary group, no other member)
    and a umask of 002, so a user's directories are group-writable by that group alone:
    counting them as shared would refuse a save into a user's own project directory."""
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o002:
        return True
    return bool(mode & 0o020) and not _own_group(info.st_uid, info.st_gid)


def _own_group(uid: int, gid: int) -> bool:
    """Whether `gid` is the private group of user `uid`: named as the user, the user's primary
    group, no other member listed. (Another account whose primary group it is would be a
    member too; no distribution makes one, and such a system is counted as the user's.)"""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return (user.pw_gid == gid and group.gr_name == user.pw_name
            and set(group.gr_mem) <= {user.pw_name})


def _trusted(entry: os.stat_result, directory: os.stat_result) -> bool:
    """Whether an entry of `directory` was put there by someone this user already trusts."""
    return (not shared(directory) or entry.st_uid in (os.geteuid(), 0, directory.st_uid))


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "no regular file")


def refuse_planted(entry: os.stat_result, directory: os.stat_result, shown: str) -> None:
    if not _trusted(entry, directory):
        raise FileRefused(
            f"{shown!r} belongs to another user (uid {entry.st_uid}) and lies in a directory "
            f"others may write (mode {stat.S_IMODE(directory.st_mode):#o}): it may have been "
            f"put there in place of yours; use a copy you made, or keep such files in a "
            f"directory only you (or its owner) can write")


class _Walk:
    """One walk of a path: the directory it stands in, and the links met so far."""

    def __init__(self, path: Path, *, create: bool, mode: int = 0o755) -> None:
        self.shown = os.fspath(path)
        if not self.shown or "\x00" in self.shown:
            raise FileRefused(f"{self.shown!r} is no path (empty, or holds a NUL byte)")
        self.create, self.mode, self.links = create, mode, 0
        # Where the walk stands, as a path without links (what `resolve` returns).
        self.where = "/" if self.shown.startswith("/") else os.getcwd()
        self.fd = os.open("/" if self.shown.startswith("/") else ".", _DIRECTORY)
        self.info = os.fstat(self.fd)
        self.parts = collections.deque(self.shown.split("/"))

    def close(self) -> None:
        os.close(self.fd)

    def _move(self, fd: int) -> None:
        os.close(self.fd)
        self.fd, self.info = fd, os.fstat(fd)

    def _link(self, name: str, entry: os.stat_result) -> None:
        """Put the link's target in the walk's way, if the link may be followed."""
        if not _trusted(entry, self.info):
            raise FileRefused(
                f"{self.shown!r}: {name!r} is a symbolic link of another user (uid "
                f"{entry.st_uid}) in a directory others may write (mode "
                f"{stat.S_IMODE(self.info.st_mode):#o}): it is not followed (it may point "
                f"anywhere, our own files included); remove it or give the real path")
        self.links += 1
        if self.links > _MAX_LINKS:
            raise FileRefused(f"{self.shown!r}: more than {_MAX_LINKS} symbolic links on the "
                              f"way (a loop?): give the real path")
        target = os.readlink(name, dir_fd=self.fd)
        if target.startswith("/"):
            self._move(os.open("/", _DIRECTORY))
            self.where = "/"
        self.parts.extendleft(reversed(target.split("/")))

    def step(self, name: str) -> None:
        """Enter directory `name` of the current one (`..` included)."""
        if name == "..":
            self._move(os.open("..", _DIRECTORY, dir_fd=self.fd))
            self.where = os.path.dirname(self.where)
            return
        entry = self.entry(name)
        if entry is None:
            if not self.create:
                self.parts.appendleft(name)  # where the walk stopped: `resolve` goes on by name
                raise FileNotFoundError(errno.ENOENT, f"no directory {name!r} on the way to "
                                        f"{self.shown!r}", self.shown)
            with contextlib.suppress(FileExistsError):  # no write for others: nobody else
                os.mkdir(name, self.mode, dir_fd=self.fd)  # may rename what is made in it
            self.parts.appendleft(name)  # look again: what is there now is checked as any
            return
        if stat.S_ISLNK(entry.st_mode):
            self._link(name, entry)
            return
        if not stat.S_ISDIR(entry.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{name!r} on the way to {self.shown!r} "
                                     f"is {kind_of(entry.st_mode)}", self.shown)
        refuse_planted(entry, self.info, self.shown)
        fd = os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (entry.st_dev, entry.st_ino):
            os.close(fd)
            self.parts.appendleft(name)  # replaced between the look and the open: look again
            return
        self._move(fd)
        self.where = os.path.join(self.where, name)

    def entry(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def last(self) -> str:
        """Walk to the directory holding the path's last entry, following links to it; its
        name there ('.' when the path names a directory by `.` or `..`)."""
        while True:
            while self.parts and self.parts[0] in ("", "."):
                self.parts.popleft()
            if not self.parts:
                return "."
            name = self.parts.popleft()
            if any(p not in ("", ".") for p in self.parts):
                self.step(name)
                continue
            if name == "..":
                self.step(name)
                return "."
            entry = self.entry(name)
            if entry is not None and stat.S_ISLNK(entry.st_mode):
                if self._kernel_object(name, entry):
                    return name  # the caller opens it through the kernel (a write only)
                self._link(name, entry)
                continue
            return name

    def _kernel_object(self, name: str, entry: os.stat_result) -> bool:
        """Whether `name` is one of this process's own descriptors (/proc/self/fd/1, which
        /dev/stdout names): a link whose target is a kernel object ("pipe:[1234]"), no path
        to walk, in a directory only its owner can write."""
        if shared(self.info) or not _trusted(entry, self.info):
            return False
        target = os.readlink(name, dir_fd=self.fd)
        return ":" in target and "/" not in target


def held_directory(path: Path, *, create: bool = False) -> tuple[int, str]:
    """The directory holding `path`'s last entry, opened (the caller closes it), and that
    entry's name in it: links on the way followed by the gate's rules, `create` making
    missing directories. The entry itself is not checked (it may be missing)."""
    walk = _Walk(path, create=create)
    try:
        name = walk.last()
    except BaseException:
        walk.close()
        raise
    return walk.fd, name


def resolve(path: Path) -> str:
    """`path` absolute and without links, each followed by the gate's rules (FileRefused for
    one it may not follow); its last entry need not exist. For callers that then work by
    name in directories only trusted users can change (`pipeline.state.staging`)."""
    walk = _Walk(path, create=False)
    try:
        try:
            name = walk.last()
        except FileNotFoundError:  # a directory on the way is missing: so is all below it
            rest = [p for p in walk.parts if p not in ("", ".")]
            return os.path.normpath(os.path.join(walk.where, *rest))
        return walk.where if name == "." else os.path.join(walk.where, name)
    finally:
        walk.close()


def open_directory(path: Path, *, create: bool = False, private: bool = False,
                   mode: int = 0o755) -> int:
    """Directory `path` itself, opened by the gate's rules (the caller closes it);
    FileNotFoundError or NotADirectoryError if there is none, `create` making it and any
    missing above it with `mode` (less the umask). With `private`, one that others may write
    is refused: its files could be swapped while it is read as a whole (a checkpoint)."""
    walk = _Walk(path, create=create, mode=mode)
    try:
        while (name := walk.last()) != ".":
            walk.step(name)  # enters it, or puts it back to be looked at again
        mode = stat.S_IMODE(walk.info.st_mode)
        if private and shared(walk.info):
            raise FileRefused(
                f"{walk.where!r} is writable by other users (mode {mode:#o}): they could "
                f"replace its files as it is read; if you trust them, chmod go-w "
                f"{walk.where!r}")
    except BaseException:
        walk.close()
        raise
    return walk.fd


def open_in(directory: int, name: str, *, shown: str, create: int | None = None) -> int:
    """Open `name` in the held `directory` as a regular file (read-only; read-write, made
    with mode `create` if absent, when that is given): never through a link, never
    blocking, never another user's file where others may write. FileNotFoundError if
    absent; FileRefused naming its kind else."""
    if name == ".":
        raise FileRefused(f"{shown!r} is a directory, not a regular file")
    flags = _READ if create is None else (_READ | os.O_RDWR | os.O_CREAT)
    try:
        fd = os.open(name, flags, 0o600 if create is None else create, dir_fd=directory)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link (EMLINK: BSD)
            raise FileRefused(f"{shown!r} is a symbolic link, not a regular file (refused: "
                              f"it may point anywhere)") from None
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO nobody reads
            raise FileRefused(f"{shown!r} is a socket or FIFO, not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise FileRefused(f"{shown!r} is a directory, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        refuse_planted(info, os.fstat(directory), shown)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{shown!r} is {kind_of(info.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: Path) -> int:
    """`path` opened read-only as a regular file, by the gate's rules (see `open_in`)."""
    directory, name = held_directory(path)
    try:
        return open_in(directory, name, shown=os.fspath(path))
    finally:
        os.close(directory)


def read_bytes(fd: int, *, limit: int, shown: str) -> bytes:
    """All of the open regular file `fd` (from its start), refused if it holds more than
    `limit` bytes (judged by its size first: a sparse 64 GiB file is never read)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise FileRefused(f"{shown!r} holds {size} bytes, more than the {limit} such a file "
                          f"may hold: it is no file of this kind, or damaged")
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, min(1 << 20, limit + 1 - offset), offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)
        if offset > limit:  # it grew while being read
            raise FileRefused(f"{shown!r} grew past {limit} bytes while being read")


def read_file(path: Path, *, limit: int) -> bytes:
    """The bytes of regular file `path`, by the gate's rules, at most `limit` of them."""
    fd = open_file(path)
    try:
        return read_bytes(fd, limit=limit, shown=os.fspath(path))
    finally:
        os.close(fd)


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def read_json(path: Path, *, limit: int, max_depth: int = 32) -> Any:
    """The JSON value in regular file `path` (`read_file`'s rules), refused (FileRefused) if it
    is not UTF-8, nests arrays and objects deeper than `max_depth` (judged before parsing:
    Python's parser would raise RecursionError), or holds NaN or Infinity. A number too large
    for a float still reads as `inf`: the caller checks its ranges."""
    return parse_json(read_file(path, limit=limit), shown=os.fspath(path), max_depth=max_depth)


def parse_json(data: bytes, *, shown: str, max_depth: int = 32) -> Any:
    """`read_json`'s checks and parse, on bytes already read through the gate (`read_bytes`
    from a file opened by `open_in`); `shown` names the file in messages."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"{shown!r} is not UTF-8 text (byte {exc.start}: {exc.reason})"
                          ) from None
    depth = 0
    for token in _JSON_TOKENS.finditer(text):
        mark = token.group()
        if mark[0] != '"':
            depth += 1 if mark in "[{" else -1
            if depth > max_depth:
                raise FileRefused(f"{shown!r} nests more than {max_depth} arrays or objects "
                                  f"deep (at character {token.start()}): it is no file of this "
                                  f"kind")

    def constant(name: str) -> None:
        raise FileRefused(f"{shown!r} holds {name}, where a number must be finite")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise FileRefused(f"{shown!r} is not JSON ({exc})") from None
