"""Every command's way out: standard output guarded, a failed write in one line, a closed pipe quiet.

`guarded(prog, fn)` runs a command's main with sys.stdout wrapped, so that a write or flush of standard
output that fails ends the command wherever it happens:
- a closed pipe (EPIPE: `anatomy plan | head -1`) ends quietly, as coreutils do: no message, exit status
  PIPE_STATUS = 128 + SIGPIPE = 141, what a shell's $? shows for a program killed by SIGPIPE;
- any other error (ENOSPC: `anatomy estimate > /dev/full`) is one line on stderr naming standard output
  and the errno text, exit 2;
- a file write that fails (llm_anatomy.io.OutputError) is one line naming the file, exit 2.
Standard output is flushed before returning, and after a failure the stdout file descriptor is pointed at
/dev/null, so the interpreter's own flush at exit has nothing left to fail on ("Exception ignored ...").
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys

from llm_anatomy.config import ConfigError, oneline
from llm_anatomy.io import OutputError

PIPE_STATUS = 128 + signal.SIGPIPE
EXIT_BAD_OUTPUT = 2


class StdoutFailed(BaseException):
    """A write to standard output failed: a BaseException, so no `except Exception` carries on writing."""

    def __init__(self, error: OSError):
        super().__init__(error)
        self.error = error


class _GuardedStdout:
    """sys.stdout as it was, with each OSError of a write or flush raised as StdoutFailed."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _call(self, name, *args):
        try:
            return getattr(self._stream, name)(*args)
        except OSError as e:
            raise StdoutFailed(e) from None

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")


def _silence(stream) -> None:
    """Point the stream's file descriptor at /dev/null: its unflushed rest goes nowhere, quietly."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def _say(prog: str, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: error: {oneline(message)}", file=sys.stderr, flush=True)


def guarded(prog: str, fn, *args) -> int:
    """fn(*args)'s exit code, with the output failures above turned into theirs. Nested calls are
    harmless: the innermost handles the failure, the outer ones see its exit code."""
    real = sys.stdout
    if isinstance(real, _GuardedStdout):
        return fn(*args)
    sys.stdout = _GuardedStdout(real)
    exiting = None
    try:
        try:
            rc = fn(*args)
        except SystemExit as e:  # argparse's --help and usage errors: their output is flushed first
            exiting, rc = e, None
        sys.stdout.flush()
    except StdoutFailed as e:
        _silence(real)
        if e.error.errno == errno.EPIPE:
            return PIPE_STATUS
        _say(prog, f"cannot write standard output: {e.error.strerror or e.error}")
        return EXIT_BAD_OUTPUT
    except (OutputError, ConfigError) as e:  # a file the command writes: not there, or not a file
        try:
            sys.stdout.flush()
        except StdoutFailed:
            _silence(real)
        _say(prog, str(e))
        return EXIT_BAD_OUTPUT
    finally:
        sys.stdout = real
    if exiting is not None:
        raise exiting
    return rc
