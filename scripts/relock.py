"""Writes requirements.lock from uv's universal, hashed compile of pyproject.toml (install.sh --relock).

python3 -m scripts.relock FULL.txt requirements.lock

torch and triton leave the lock with what only they pull (nvidia-*, cuda-*): install.sh puts them in place
first, so that a GPU machine keeps the CUDA build it has and the triton built with it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from llm_anatomy.io import write_atomic

HEAD = """# The locked set the CPU suite is tested on: every dependency of efficient-llm-anatomy (extras hf, train)
# except torch and triton, which install.sh puts in place first (a GPU machine keeps the CUDA build of both it
# has; a machine with none gets torch==2.13.0 CPU and triton==3.9.0). Universal (any platform), hashed.
# Regenerate: bash install.sh --relock
"""
REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")


def left_out(name: str) -> bool:
    name = name.lower()
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def strip(text: str) -> str:
    """uv's output less the entries left_out names (an entry: its requirement line and the lines under it)."""
    out, keep = [], True
    for line in text.splitlines():
        if m := REQ.match(line):
            keep = not left_out(m.group(1))
        if keep:
            out.append(line)
    return HEAD + "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python3 -m scripts.relock UV_OUTPUT requirements.lock", file=sys.stderr)
        return 2
    try:
        text = Path(argv[0]).read_text()
    except OSError as e:
        print(f"scripts.relock: cannot read {argv[0]}: {e.strerror}", file=sys.stderr)
        return 2
    write_atomic(argv[1], strip(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
