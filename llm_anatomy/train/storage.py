"""What a failed write says: one line naming what could not be written, the path and the errno (a full disk,
a read-only folder, a quota), for the lock, the tokenizer cache, the checkpoints and the run's log alike."""
from __future__ import annotations

import errno

from llm_anatomy.config import ConfigError


class StorageError(ConfigError):
    """A file of the run could not be written: one line, exit 2."""


def storage_error(e: OSError, what: str) -> StorageError:
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "no errno"
    full = ": the disk holding it is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    where = f" ({e.filename})" if e.filename and str(e.filename) not in what else ""
    return StorageError(f"cannot write {what}{where}: {e.strerror or e} [{code}]{full}")
