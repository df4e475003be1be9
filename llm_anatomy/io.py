"""Files the user names: read only when regular and of a bounded size, written all or nothing.

Reading (`open_input`, `read_input`): the path is stat'ed first, so a FIFO, a device, a directory or a
socket is refused in one line before anything is opened (a FIFO would block, /dev/zero never ends), and
the file is opened with O_NONBLOCK and fstat'ed again, so a path swapped for a FIFO in between cannot
block either. Each kind of input states its own bound (a config is kB, a training text can be GB).

Writing (`write_atomic`): a target that exists and is not a regular file is refused (renaming over
/dev/null would replace the device). The temporary file is created exclusively (`mkstemp`: O_CREAT |
O_EXCL, a random name, so a link planted at any name is never followed and concurrent writers never
share one) in the target's own folder, so the final `os.replace` is a rename within one file system; it
is fsynced before the rename and the folder after it, so a crash never leaves a half-written file. Any
failure removes the temporary file and raises OutputError: one line naming the path and the errno text.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from llm_anatomy.config import ConfigError, oneline


class OutputError(OSError):
    """A write that failed: its str is one line naming the path and the reason."""

    def __str__(self) -> str:
        return f"cannot write {oneline(str(self.filename), 200)}: {self.strerror}"


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_unless_regular(mode: int, where: str, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where} is {_kind(mode)}, not a regular file; a {what} must be one")


def open_input(path: str | os.PathLike, what: str, limit: int):
    """A binary file object on `path`, a regular file of at most `limit` bytes; a ConfigError of one line
    naming the path otherwise (missing, unreadable, special, or too large)."""
    where = oneline(repr(str(path)), 200)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"cannot read {what} {where}: {e.strerror or e}") from None
    except ValueError:  # a NUL byte in the path
        raise ConfigError(f"cannot read {what} {where}: not a valid path") from None
    _refuse_unless_regular(mode, where, what)  # before any open: a FIFO would block, a device may act
    try:
        st = os.fstat(fd)
        _refuse_unless_regular(st.st_mode, where, what)  # the path may have changed since the stat
        if st.st_size > limit:
            raise ConfigError(f"{where} is {st.st_size:,} bytes, over the {limit:,}-byte bound of a {what}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of `path` (as open_input), at most `limit` of them even if the file grows while read."""
    with open_input(path, what, limit) as f:
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise ConfigError(f"cannot read {what} {oneline(repr(str(path)), 200)}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise ConfigError(f"{oneline(repr(str(path)), 200)} grew past the {limit:,}-byte bound of a {what} "
                          "while read")
    return raw


def refuse_special_target(path: str | os.PathLike, what: str = "output") -> None:
    """A ConfigError of one line when `path` exists and is not a regular file (a device, a FIFO, a socket,
    a directory): a write would replace it. Absent paths and regular files pass."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # absent (or unreachable): the write itself says why, if it fails
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{oneline(repr(str(path)), 200)} is {_kind(mode)}; an {what} must be a regular file "
                          "or a new path (writing would replace it)")


def _new_mode(path: Path) -> int:
    """The replaced file's permissions, or for a new file 0666 less the process's umask (as open() gives)."""
    with contextlib.suppress(OSError, ValueError):
        return stat.S_IMODE(os.stat(path).st_mode)
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read where Linux says it (setting it to read it would race other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, data: str | bytes, *, parents: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` all or nothing; `parents`: create missing folders first.
    A target that is not a regular file raises ConfigError; a failed write raises OutputError."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    refuse_special_target(path)
    mode = _new_mode(path)
    folder = path.parent
    try:
        if parents:
            folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise OutputError(e.errno, e.strerror or str(e), str(path)) from None
    except ValueError:
        raise OutputError(errno.EINVAL, "not a valid path (a NUL byte)", str(path)) from None
    try:
        try:
            os.fchmod(fd, mode)  # mkstemp's 0600 would hide a report from the user's group
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        refuse_special_target(path)  # swapped for a device while written: the temp file goes, not the device
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(e.errno or errno.EIO, e.strerror or str(e), str(path)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
