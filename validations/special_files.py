"""Files that are not regular files, made for the tests that aim commands at them, and a file system that
fails on demand (an injected errno at one system call) where a real full or read-only one cannot be made."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

# what each kind is, in the one line a refusal says
KIND_WORDS = {"fifo": "FIFO", "zero-link": "character device", "dir": "directory", "socket": "socket",
              "chardev": "character device"}
KINDS = tuple(KIND_WORDS)
_SOCKETS: list[socket.socket] = []  # kept open while the test runs; closed at exit


def make_special(kind: str, path: str | Path) -> Path:
    """A `kind` file at `path` (relative paths: keep them short, a UNIX socket's name has 107 bytes at most).
    chardev is /dev/null's numbers made with mknod, which needs CAP_MKNOD: skipped with the reason where
    that is refused."""
    path = Path(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero-link":
        os.symlink("/dev/zero", path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        _SOCKETS.append(s)
    elif kind == "chardev":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError as e:
            pytest.skip(f"mknod of a character device is not permitted here ({e.strerror})")
    else:
        raise ValueError(kind)
    return path


def mode_of(path: str | Path) -> int:
    return os.lstat(path).st_mode


def still_special(kind: str, path: str | Path, before: int) -> bool:
    """The special file is what it was: same type (a link still a link), never replaced by a regular file."""
    return mode_of(path) == before and not stat.S_ISREG(os.lstat(path).st_mode)


@contextlib.contextmanager
def failing(monkeypatch, call: str, err: int, name: str):
    """While the block runs, a write to a temp file of `name` fails with OSError(err): call "write" makes
    os.write on it fail (a full disk: ENOSPC), "mkstemp" its creation (a read-only folder: EROFS, or EACCES,
    which root's permissions would otherwise bypass). Other files are written as usual."""
    mine = f".{name}."

    def fail():
        raise OSError(err, os.strerror(err))

    if call == "write":
        real = os.write

        def write(fd, data):
            try:
                ours = os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(mine)
            except OSError:
                ours = False
            if ours:
                fail()
            return real(fd, data)

        target, attr, fake = os, "write", write
    else:
        real = tempfile.mkstemp

        def mkstemp(*a, prefix=None, **k):
            if prefix and prefix.startswith(mine):
                fail()
            return real(*a, prefix=prefix, **k)

        target, attr, fake = tempfile, "mkstemp", mkstemp
    with monkeypatch.context() as m:
        m.setattr(target, attr, fake)
        yield


ENOSPC, EROFS, EACCES = errno.ENOSPC, errno.EROFS, errno.EACCES


def without_progress(err: str) -> str:
    """stderr less `anatomy sweep`'s progress bar: a report of the work done, drawn before any failure."""
    return "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith("sweep ━"))
