"""The CUDA caching allocator's rounding, which every byte the memory model places goes through."""
from __future__ import annotations

BLOCK = 512  # the CUDA caching allocator's rounding (kMinBlockSize)


def rounded(nbytes: int) -> int:
    """nbytes rounded up to whole blocks, at least one block; 0 for 0 (a negative size is one block)."""
    if nbytes > 0:
        return -(-nbytes // BLOCK) * BLOCK  # at least BLOCK
    return BLOCK if nbytes else 0
