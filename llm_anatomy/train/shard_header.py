"""A safetensors shard's header, checked before safetensors or torch reads the file: a header whose sha256 the
manifest vouches for can still be crafted (the manifest re-signed to match), so its structure is checked too.

The format: 8 bytes (little-endian header length n), n bytes of JSON, then the data. The JSON maps each
tensor's name to {dtype, shape, data_offsets: [begin, end]} (offsets into the data), plus an optional
`__metadata__` of strings. A shard passes only if n fits the file and the limit below, the JSON is an object
of such entries, every dtype is known, (end - begin) = numel x the dtype's size, and the tensors' byte ranges
tile the data from 0 to its end with no gap and no overlap (what safetensors itself requires).
"""
from __future__ import annotations

import json
from math import prod

MAX_HEADER = 100 << 20  # safetensors' own limit on the header (100 MB)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
            "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


class BadHeader(ValueError):
    """The one-line reason a shard's header is not a valid safetensors header."""


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check(prefix: bytes, size: int) -> dict:
    """The parsed header of a file of `size` bytes beginning with `prefix` (at least 8 + n bytes of it, or all of
    a shorter file); BadHeader otherwise."""
    if size < 8 or len(prefix) < 8:
        raise BadHeader(f"{size} bytes: shorter than a header's length field")
    n = int.from_bytes(prefix[:8], "little")
    if n > min(MAX_HEADER, size - 8):
        raise BadHeader(f"its header length {n:,} is past the file's {size:,} bytes or the {MAX_HEADER:,}-byte limit")
    if len(prefix) < 8 + n:
        raise BadHeader("its header is cut short")
    try:
        header = json.loads(prefix[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadHeader(f"its header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise BadHeader("its header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise BadHeader("its __metadata__ is not a map of strings")
    spans, data = [], size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(t, dict) and t.get("dtype") in ITEMSIZE and isinstance(t.get("shape"), list)
                and all(_int(d) for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2 and all(_int(o) for o in t["data_offsets"])):
            raise BadHeader(f"tensor {name[:80]!r} lacks a known dtype, a shape or two data offsets")
        begin, end = t["data_offsets"]
        if begin > end or end > data:
            raise BadHeader(f"tensor {name[:80]!r} has offsets [{begin}, {end}] out of range (the data is {data:,} "
                            f"bytes)")
        nbytes = prod(t["shape"]) * ITEMSIZE[t["dtype"]]
        if end - begin != nbytes:
            raise BadHeader(f"tensor {name[:80]!r}: {t['dtype']} {t['shape']} is {nbytes:,} bytes, its offsets span "
                            f"{end - begin:,}")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the one before" if begin < at else f"leaves a gap of {begin - at:,} bytes"
            raise BadHeader(f"tensor {name[:80]!r} at offsets [{begin}, {end}] {what}")
        at = end
    if at != data:
        raise BadHeader(f"its tensors cover {at:,} bytes of data, the file holds {data:,}")
    return header


def check_file(path) -> dict:
    """check() on a file, reading its header only."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return check(head + (f.read(n) if n <= min(MAX_HEADER, size - 8) else b""), size)
