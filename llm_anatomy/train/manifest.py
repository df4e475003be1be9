"""What makes a checkpoint trustworthy: its manifest, checked before a byte of it is loaded.

A checkpoint folder step-NNNNNNNN/ holds
    shard-RRRRR-of-WWWWW.safetensors   one per rank that wrote it (safetensors: a JSON header and raw
                                       tensor bytes; nothing in it can run code)
    trainer.json                       the step, the data position, the loss history, the run's identity
    manifest.json                      written last: the format, the step, the world size, and the size
                                       and sha256 of every other file; its own sha256 over the rest

`check()` accepts a folder only if every one of these holds: the folder and its files are real
files (no links), the manifest parses and its self-digest matches, the folder's name, the
manifest's step and trainer.json's step agree, and every listed file exists with the listed size
and sha256. A truncated, missing or zero-filled shard, a flipped bit anywhere (a weight, an
optimizer moment, the step counter), a broken JSON file: each fails one of these and is named
in the one-line reason. Nothing else in the folder (a `.metadata` pickle, say) is ever opened.

`find()` walks the run directory from the preferred checkpoint (the `latest` pointer's, or the
one asked for) to older ones and returns the first that passes; the `latest` pointer must name
a checkpoint inside the run directory, or the run is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from llm_anatomy.config import ConfigError
from llm_anatomy.train import shard_header

FORMAT = "anatomy-checkpoint/1"
MANIFEST, TRAINER, LATEST = "manifest.json", "trainer.json", "latest"
STEP_RE = re.compile(r"step-(\d{8})")
MAX_JSON = 64 << 20  # a manifest or trainer file larger than this is not ours (the history is ~40 B a step)


class Damaged(Exception):
    """A checkpoint that fails a check; the message is the one-line reason."""


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def step_of(p: Path) -> int | None:
    m = STEP_RE.fullmatch(p.name)
    return int(m.group(1)) if m else None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _self_digest(body: dict) -> str:
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def manifest_text(step: int, world: int, files: dict[str, tuple[str, int]]) -> str:
    body = dict(format=FORMAT, step=step, world=world,
                files={name: dict(sha256=h, bytes=n) for name, (h, n) in sorted(files.items())})
    return json.dumps(dict(body, sha256=_self_digest(body)), indent=1) + "\n"


def _regular(p: Path, what: str) -> os.stat_result:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise Damaged(f"{what} is missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise Damaged(f"{what} is not a regular file (a link or a folder)")
    return st


def read_json(p: Path, what: str) -> dict:
    st = _regular(p, what)
    if st.st_size > MAX_JSON:
        raise Damaged(f"{what} is {st.st_size:,} bytes, too large to be ours")
    try:
        obj = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Damaged(f"{what} is not valid JSON ({e.__class__.__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise Damaged(f"{what} is not a JSON object")
    return obj


def _digest_file(p: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def read_manifest(folder: Path) -> dict:
    """The manifest of `folder`, its structure and self-digest checked (the files are not read)."""
    m = read_json(folder / MANIFEST, MANIFEST)
    body = {k: v for k, v in m.items() if k != "sha256"}
    if m.get("sha256") != _self_digest(body):
        raise Damaged(f"{MANIFEST} does not match its own sha256 (edited or corrupted)")
    world, files = m.get("world"), m.get("files")
    if m.get("format") != FORMAT:
        raise Damaged(f"{MANIFEST} has format {m.get('format')!r}, not {FORMAT!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1 or not isinstance(files, dict):
        raise Damaged(f"{MANIFEST} lacks a world size or a file list")
    want = {TRAINER, *(shard_name(r, world) for r in range(world))}
    if set(files) != want:
        raise Damaged(f"{MANIFEST} lists {sorted(files)[:4]}, not the {len(want)} files of a {world}-rank checkpoint")
    for name, f in files.items():
        if not (isinstance(f, dict) and isinstance(f.get("sha256"), str) and isinstance(f.get("bytes"), int)):
            raise Damaged(f"{MANIFEST}'s entry for {name} lacks a sha256 or a size")
    if m.get("step") != step_of(folder):
        raise Damaged(f"{MANIFEST} says step {m.get('step')!r} in folder {folder.name}")
    return m


def check(folder: Path) -> dict:
    """The manifest of an intact checkpoint folder; Damaged (one-line reason) otherwise."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise Damaged("the folder is missing") from None
    if stat.S_ISLNK(st.st_mode):
        raise Damaged("it is a symbolic link, not a folder a run wrote (links are never followed)")
    if not stat.S_ISDIR(st.st_mode):
        raise Damaged("it is a plain file (or another non-folder), not a checkpoint folder")
    m = read_manifest(folder)
    for name, want in m["files"].items():
        size = _regular(folder / name, name).st_size
        if size != want["bytes"]:
            raise Damaged(f"{name} is {size:,} bytes, the manifest says {want['bytes']:,} (truncated or grown)")
        if _digest_file(folder / name)[0] != want["sha256"]:
            raise Damaged(f"{name} does not match its sha256 in the manifest (corrupted)")
        if name != TRAINER:
            try:
                shard_header.check_file(folder / name)
            except shard_header.BadHeader as e:
                raise Damaged(f"{name} is not a valid safetensors file: {e}") from None
    check_trainer(read_json(folder / TRAINER, TRAINER), m["step"])
    return m


TRAINER_FIELDS = dict(step=int, consumed=int, steps=int, history=dict, identity=dict)
HISTORY_FIELDS = ("loss", "lr", "tokens_per_s", "eval")


def check_trainer(tr: dict, step: int) -> None:
    for k, typ in TRAINER_FIELDS.items():
        if isinstance(tr.get(k), bool) or not isinstance(tr.get(k), typ):
            raise Damaged(f"{TRAINER} lacks {k} ({typ.__name__})")
    if tr["step"] != step:
        raise Damaged(f"{TRAINER} says step {tr['step']}, the manifest {step}")
    h = tr["history"]
    if not all(isinstance(h.get(k), list) for k in HISTORY_FIELDS) or len(h["loss"]) != step:
        raise Damaged(f"{TRAINER}'s history does not hold {step} steps")


def candidates(run_dir: Path) -> list[Path]:
    """Entries named like a checkpoint (step-NNNNNNNN) under run_dir, newest first: a link or a plain file by
    that name is among them, so that check() names it when it is passed over; temp folders are not."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p), reverse=True)


def read_latest(run_dir: Path) -> Path | None:
    """The checkpoint the `latest` pointer names (None without a pointer); ConfigError when the pointer
    leads outside the run directory or is not a file."""
    ptr = run_dir / LATEST
    if not os.path.lexists(ptr):
        return None
    if ptr.is_symlink() or not ptr.is_file():
        raise ConfigError(f"{ptr} is a link or a folder, not the pointer file a run writes: refused")
    raw = ptr.read_bytes()[:200]
    name = raw.decode("utf-8", "replace").strip()
    if not STEP_RE.fullmatch(name):
        shown = name.encode("unicode_escape").decode()[:80]
        raise ConfigError(f"{ptr} points outside the run directory ({shown!r}); a pointer names a step-NNNNNNNN "
                          f"folder beside it: refused")
    return run_dir / name


def find(run_dir: Path, prefer: Path | None, warn: Callable[[str], None]) -> tuple[Path | None, int]:
    """(the newest intact checkpoint at or before `prefer`, how many were skipped as damaged)."""
    limit = step_of(prefer) if prefer is not None else None
    skipped = 0
    for p in candidates(run_dir):
        if limit is not None and step_of(p) > limit:
            continue
        try:
            check(p)
            return p, skipped
        except Damaged as e:
            skipped += 1
            warn(f"checkpoint {p} is damaged: {e}")
        except OSError as e:
            skipped += 1
            warn(f"checkpoint {p} cannot be read: {e.strerror or e}")
    return None, skipped
