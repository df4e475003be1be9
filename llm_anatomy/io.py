"""Safe file writes: a file is either its old content or its new one, and a planted link never
redirects a write.

The temporary file is created exclusively (`mkstemp`: O_CREAT | O_EXCL, a random name) in the target's
own folder, so the final `os.replace` is a rename within one file system; it is flushed and fsynced
before the rename, and the folder is fsynced after it, so a crash never leaves a half-written file.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` all or nothing."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
