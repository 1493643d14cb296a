"""The gate for files: every file the project reads or writes outside its own process passes here.

A path is walked one component at a time from directory descriptors the gate holds, never by
name from the top again, so what it checked is what it opens. Three rules, for every reader
and writer alike (checkpoints, time models, schedule CSVs, pipeviz and benchmark outputs):

- **No link it did not make.** A symbolic link is followed only where nobody else could have
  put it: in a directory no other user may write (mode without group or others' write), or
  owned by this user, root, or the directory's owner (the kernel's `protected_symlinks` rule,
  applied to every directory, not only sticky ones). Its target is walked by the same rules.
- **Nothing planted.** In a directory others may write, an entry (file or directory) of
  another user than this one, root or the directory's owner is refused: it may have been put
  there in place of one of ours.
- **Regular files only, bounded.** A file is opened without following a link and without
  blocking (a FIFO never stalls a reader), then checked to be a regular file, and read up to
  a size the caller bounds. A write goes to a fresh temporary sibling (`O_EXCL`, the final
  mode from the first byte), is fsynced and renamed into place from the same directory
  descriptor, and the directory is fsynced: the file holds its old content or the new, whole.

What stays beyond it: root, and the owner of a directory on the path, can change anything
under it; the gate trusts them, as the kernel does.
"""

from schedules.files.walk import (
                                  FileRefused,
                                  held_directory,
                                  open_directory,
                                  open_file,
                                  open_in,
                                  parse_json,
                                  read_bytes,
                                  read_file,
                                  read_json,
                                  resolve,
                                  shared,
)
from schedules.files.write import fsync_directory, write_atomic, write_in

__all__ = ["FileRefused", "fsync_directory", "held_directory", "open_directory", "open_file",
           "open_in", "parse_json", "read_bytes", "read_file", "read_json", "resolve", "shared",
           "write_atomic", "write_in"]
