"""One run per directory: `<dir>/.lock` holds the owner's pid and host while rank 0 holds an flock on it.

A second run finds the flock taken and refuses in one line naming the owner. A run killed with
SIGKILL releases its flock with its process, so its lock is stale by construction; the pid and host
in the file add a second check where flock is not shared (a network file system): a lock written by
another host is never broken, one of this host whose pid is gone is. A normal exit deletes the file.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from llm_anatomy.config import ConfigError
from llm_anatomy.train.storage import storage_error

NAME = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, folder: str | Path):
        self.path = Path(folder) / NAME
        self.fd: int | None = None

    def _refuse(self, owner: dict) -> ConfigError:
        return ConfigError(f"{self.path.parent} is in use by another run (pid {owner.get('pid', '?')} on "
                           f"{owner.get('host', '?')}, since {owner.get('since', '?')}); wait for it, or use another "
                           f"--ckpt-dir (if no run is using it, delete {self.path})")

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e, f"the run directory {self.path.parent}") from None
        host = socket.gethostname()
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError as e:
                raise storage_error(e, f"the run lock {self.path}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read(fd)
                os.close(fd)
                raise self._refuse(owner) from None
            try:  # the file we locked must still be the one at the path (a finishing owner unlinks it)
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        owner = _read(fd)
        pid = owner.get("pid")
        if owner and (owner.get("host") != host or (isinstance(pid, int) and pid != os.getpid() and _alive(pid))):
            os.close(fd)  # flock free but the owner may live: another host, or a file system without flock
            raise self._refuse(owner)
        me = dict(pid=os.getpid(), host=host, since=time.strftime("%Y-%m-%d %H:%M:%S"))
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk or quota: the lock we hold is ours to remove
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise storage_error(e, f"the run lock {self.path}") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode()) if raw.strip() else {}
        return owner if isinstance(owner, dict) else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # not a lock a run wrote: nothing to honour
