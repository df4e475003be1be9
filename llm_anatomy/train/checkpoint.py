"""Checkpoints: safetensors shards, a JSON trainer file and a manifest, committed atomically; nothing
read back can run code (no pickle, no torch.load).

The folder's files and checks: llm_anatomy/train/manifest.py. What a shard holds (every rank writes its own):
    model/<fqn>               the parameter: this rank's dim-0 shard of the DTensor under FSDP2 (FSDP2
                              shards every parameter on dim 0, in rank order); a replicated tensor (one
                              process, DDP) whole, in rank 0's shard only
    optim/<fqn>/<key>         the optimizer's tensor state, sharded the same way; non-tensor state (AdEMAMix's
                              step, a Python int) goes to the header's `scalars`
    rng/torch, rng/cuda       this rank's torch generator states; Python's in the header's `python_rng`
and a header `sharded`: the keys that are dim-0 shards. Loading concatenates a sharded key's pieces
over the ranks that wrote them, so any world size resumes any other, and hands the full tensors to
set_state_dict, which keeps this rank's part. Every rank reads (and verifies) every shard: fine at the
sizes this trainer runs on CPU; a GPU-sized run would read ranges instead.

On a tensor- or pipeline-parallel mesh (per_rank, train/mesh.py) every rank writes all it holds: each
DTensor's local tensor (TP's row / column / vocab shards, FSDP2's dim-0 shards of them) and a pipeline
stage's plain tensors, with the header's `layout` naming the mesh; trainer.json names it too. Loading reads
the rank's own shard and rebuilds each DTensor from it with the placements it has now (_placed), so a
resume needs the same mesh: another layout is refused in one line.

Why atomic, and how. Every save goes to a fresh `.tmp-step-N-XXXX/` (an exclusive mkdtemp, so a planted
link cannot redirect it); every rank writes and fsyncs its shard; rank 0 writes trainer.json and then
the manifest with every file's sha256, renames the folder to `step-N/` and replaces `latest`
(write_atomic). A kill at any point leaves `latest` at an intact checkpoint or at none.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from llm_anatomy.config import ConfigError
from llm_anatomy.io import fsync_dir, write_atomic
from llm_anatomy.train import manifest as mf
from llm_anatomy.train import ranks, shard_header
from llm_anatomy.train.storage import StorageError, storage_error  # noqa: F401 (re-exported)


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step-{step:08d}"


# ---- state dicts <-> flat tensors -------------------------------------------------------------------
def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _flatten(msd: dict, osd: dict, per_rank: bool = False) -> tuple[dict[str, torch.Tensor], list[str], dict]:
    """(tensors by key, the keys that are dim-0 shards, non-tensor optimizer state by key). per_rank: every
    DTensor as its local tensor, whatever its placements."""
    tensors, sharded, scalars, seen = {}, [], {}, set()

    def put(key: str, v) -> None:
        if per_rank and _is_dtensor(v):
            v = v.to_local()
        elif _is_dtensor(v):
            if [type(pl).__name__ for pl in v.placements] != ["Shard"] or v.placements[0].dim != 0:
                raise ConfigError(f"cannot checkpoint {key}: placements {v.placements}, not one dim-0 shard")
            v = v.to_local()
            sharded.append(key)
        t = v.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # tied weights: safetensors stores no aliases
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t

    for fqn, v in msd.items():
        put(f"model/{fqn}", v)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                put(f"optim/{fqn}/{k}", v)
            elif isinstance(v, (bool, int, float)):
                scalars[f"optim/{fqn}/{k}"] = v
            else:
                raise ConfigError(f"cannot checkpoint optimizer state {fqn}/{k} of type {type(v).__name__}")
    return tensors, sharded, scalars


def _rng_tensors() -> tuple[dict[str, torch.Tensor], str]:
    t = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        t["rng/cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    return t, json.dumps([version, list(state), gauss])


def _set_rng(tensors: dict[str, torch.Tensor], python_rng: str) -> None:
    version, state, gauss = json.loads(python_rng)
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])


# ---- save -------------------------------------------------------------------------------------------
def _fail_together(err: OSError | None, what: str) -> None:
    """Every rank raises when any rank failed to write (a rank that raised alone would hang the rest)."""
    code = ranks.max_int((err.errno or errno.EIO) if err is not None else 0)
    if code:
        raise storage_error(err if err is not None else OSError(code, os.strerror(code)), what)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sweep_temps(d: Path) -> None:
    """Remove the temp folders of saves that never committed (the run lock says none is in flight)."""
    for stale in d.glob(".tmp-step-*"):
        if stale.is_symlink() or not stale.is_dir():
            stale.unlink(missing_ok=True)
        else:
            shutil.rmtree(stale, ignore_errors=True)


def save(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         trainer: dict, *, before_commit: Callable[[Path], None] | None = None, per_rank: bool = False) -> Path:
    """Save on every rank (a collective under torchrun); returns the committed folder. StorageError when
    any rank cannot write (every rank raises it). before_commit(tmp) runs on rank 0 after the manifest
    and before the rename (a test seam). per_rank: each rank writes everything it holds (a mesh's layout)."""
    d, rank = Path(ckpt_dir), ranks.rank()
    final, tmp, fail = step_dir(d, step), None, None
    if rank == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            _sweep_temps(d)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=d))
        except OSError as e:
            fail = e
    _fail_together(fail, f"checkpoints to {d}")
    tmp = d / ranks.str_from_rank0(tmp.name if tmp else "")
    try:
        _write_shard(tmp, final, model, optimizer, trainer, step, before_commit, per_rank)
    except StorageError:
        if rank == 0:  # a save that did not commit leaves nothing behind; the last good checkpoint is untouched
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_shard(tmp: Path, final: Path, model, optimizer, trainer: dict, step: int, before_commit,
                 per_rank: bool = False) -> None:
    """Every rank writes its shard into tmp; rank 0 commits tmp as `final`. StorageError on every rank when any
    rank failed."""
    rank, world, fail = ranks.rank(), ranks.world(), None
    msd, osd = get_state_dict(model, optimizer)
    tensors, sharded, scalars = _flatten(msd, osd, per_rank)
    if rank != 0 and not per_rank:  # a replicated tensor (DDP's every one, FSDP2's AdamW step) is written by rank 0 alone
        tensors = {k: tensors[k] for k in sharded}
    rng, python_rng = _rng_tensors()
    meta = dict(format=mf.FORMAT, rank=str(rank), world=str(world), sharded=json.dumps(sharded),
                scalars=json.dumps(scalars), python_rng=python_rng, layout=str(trainer.get("layout") or ""))
    blob = st_save({**tensors, **rng}, metadata=meta)
    try:
        _write_new(tmp / mf.shard_name(rank, world), blob)
    except OSError as e:
        fail = e
    digests = ranks.gather_digests(bytes.fromhex(mf.sha256_bytes(blob)), len(blob))
    _fail_together(fail, f"checkpoint {final}")
    if rank == 0:
        try:
            _commit(final.parent, tmp, final, step, trainer, digests, before_commit)
        except OSError as e:
            fail = e
    _fail_together(fail, f"checkpoint {final}")


def _commit(d: Path, tmp: Path, final: Path, step: int, trainer: dict, digests: list[tuple[str, int]],
            before_commit) -> None:
    world = len(digests)
    text = json.dumps(dict(trainer, step=step), indent=1).encode()
    _write_new(tmp / mf.TRAINER, text)
    files = {mf.shard_name(r, world): dg for r, dg in enumerate(digests)}
    files[mf.TRAINER] = (mf.sha256_bytes(text), len(text))
    _write_new(tmp / mf.MANIFEST, mf.manifest_text(step, world, files).encode())  # last: it vouches for the rest
    fsync_dir(tmp)
    if before_commit is not None:
        before_commit(tmp)
    old = None
    if os.path.lexists(final):  # re-saving a step (a run resumed from an older checkpoint): swap it out
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=d))
        final.rename(old / final.name)
    try:
        tmp.rename(final)
    except OSError:
        if old is not None:  # the step's previous checkpoint goes back where it was
            (old / final.name).rename(final)
            old.rmdir()
        raise
    fsync_dir(d)
    write_atomic(d / mf.LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(written: list[Path], keep: int) -> list[Path]:
    """Delete the oldest of the checkpoints this run wrote beyond the newest `keep` (0 keeps all);
    returns those left. A checkpoint this run did not write is never touched."""
    if keep <= 0 or len(written) <= keep:
        return written
    for p in written[:-keep]:
        if ranks.rank() == 0 and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
    return written[-keep:]


# ---- load -------------------------------------------------------------------------------------------
def _read_verified(folder: Path, name: str, m: dict) -> bytes:
    data = (folder / name).read_bytes()
    if mf.sha256_bytes(data) != m["files"][name]["sha256"]:
        raise mf.Damaged(f"{name} changed after it was verified")
    return data


def _read_shards(folder: Path, m: dict, which: list[int] | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict, list[dict], list[dict]]:
    """(full tensors by key, scalars, the rng tensors and the header of each rank in `which`, default all)."""
    pieces: dict[str, list[torch.Tensor]] = {}
    headers, rngs = [], []
    for r in (range(m["world"]) if which is None else which):
        data = _read_verified(folder, mf.shard_name(r, m["world"]), m)
        try:  # the structure checked before safetensors parses a byte of it
            header = shard_header.check(data, len(data)).get("__metadata__", {})
        except shard_header.BadHeader as e:
            raise mf.Damaged(f"{mf.shard_name(r, m['world'])} is not a valid safetensors file: {e}") from None
        shard = st_load(data)
        rngs.append({k: v for k, v in shard.items() if k.startswith("rng/")})
        headers.append(header)
        for k, v in shard.items():
            if not k.startswith("rng/"):
                pieces.setdefault(k, []).append(v)
    sharded, scalars = json.loads(headers[0]["sharded"]), json.loads(headers[0]["scalars"])
    if not (isinstance(sharded, list) and isinstance(scalars, dict)
            and all(isinstance(v, (bool, int, float)) for v in scalars.values())):
        raise mf.Damaged("a shard's header lists no sharded keys or non-numeric scalars")
    for h in headers:
        version, state, gauss = json.loads(h["python_rng"])  # checked now: restored after the weights
        if not (isinstance(version, int) and isinstance(state, list) and len(state) == 625  # MT19937's 624 + index
                and all(isinstance(x, int) for x in state) and (gauss is None or isinstance(gauss, float))):
            raise mf.Damaged("a shard's header holds no Python RNG state")
    full = {k: (torch.cat(v) if k in set(sharded) else v[0]) for k, v in pieces.items()}
    return full, scalars, rngs, headers


def load(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         layout: str | None = None) -> dict:
    """Load an intact checkpoint folder (manifest.check() passed on rank 0) into model and optimizer on
    every rank; returns the trainer dict. This rank's RNG state is restored when the checkpoint has one
    for it. ConfigError (on every rank) when a file changed since the check, the checkpoint holds
    another model or optimizer, or it was written on another mesh layout than `layout` (train.mesh.layout)."""
    fail, r = None, ranks.rank()
    try:
        m = mf.read_manifest(folder)
        trainer = json.loads(_read_verified(folder, mf.TRAINER, m))
        mf.check_trainer(trainer, m["step"])
    except (mf.Damaged, OSError, ValueError, KeyError, TypeError) as e:
        fail = e
    _unreadable_together(folder, fail)
    if (trainer.get("layout") or None) != layout:  # every rank read the same verified trainer.json
        raise ConfigError(f"checkpoint {folder} was written on {_mesh_words(trainer.get('layout'))}, this run is on "
                          f"{_mesh_words(layout)}: a mesh's checkpoint keeps each rank's shards, so resume it on "
                          f"the same mesh")
    try:
        full, scalars, rngs, headers = _read_shards(folder, m, [r] if layout else None)
    except (mf.Damaged, OSError, ValueError, KeyError, TypeError) as e:
        fail = e
    _unreadable_together(folder, fail)
    msd, osd = get_state_dict(model, optimizer)  # a fresh optimizer's state is created (an lr=0 step)
    want = _flatten_keys(msd, osd)
    got = set(full) | set(scalars)
    if want != got:
        miss, extra = sorted(want - got)[:3], sorted(got - want)[:3]
        who = trainer.get("identity", {})
        raise ConfigError(f"checkpoint {folder} holds another model or optimizer (it was written with the "
                          f"{who.get('variant')} variant and {who.get('optimizer')}; missing {miss}, unexpected {extra})")
    new_msd = {fqn: full[f"model/{fqn}"] for fqn in msd}
    for fqn, t in new_msd.items():
        now = msd[fqn].to_local() if layout and _is_dtensor(msd[fqn]) else msd[fqn]
        if tuple(t.shape) != tuple(now.shape):
            raise ConfigError(f"checkpoint {folder} holds {fqn} of shape {tuple(t.shape)}, this model "
                              f"{tuple(now.shape)}")
    state = {fqn: {k: (full[f"optim/{fqn}/{k}"] if isinstance(v, torch.Tensor) else scalars[f"optim/{fqn}/{k}"])
                   for k, v in st.items()} for fqn, st in osd["state"].items()}
    distributed = any(_is_dtensor(v) for v in msd.values())
    if layout:  # this rank's own tensors, placed as this run's are
        new_msd = {fqn: _placed(t, msd[fqn]) for fqn, t in new_msd.items()}
        state = {fqn: {k: _placed(v, osd["state"][fqn][k]) for k, v in st.items()} for fqn, st in state.items()}
    set_state_dict(model, optimizer, model_state_dict=new_msd,
                   optim_state_dict=dict(state=state, param_groups=osd["param_groups"]),
                   options=StateDictOptions(full_state_dict=distributed and not layout))
    i = 0 if layout else r  # per-rank: only this rank's shard was read
    if i < len(rngs) and "rng/torch" in rngs[i]:
        _set_rng(rngs[i], headers[i]["python_rng"])
    trainer["path"] = str(folder)
    return trainer


def _unreadable_together(folder: Path, fail: Exception | None) -> None:
    """ConfigError on every rank when any rank could not read (a rank that raised alone would hang the rest)."""
    if ranks.max_int(int(fail is not None)):
        raise ConfigError(f"checkpoint {folder} changed or became unreadable while it was loaded: "
                          f"{fail if fail is not None else 'on another rank'}")


def _mesh_words(layout: str | None) -> str:
    return f"the mesh {layout}" if layout else "no mesh (one process, DDP or FSDP)"


def _placed(t, like):
    """t (this rank's local tensor) as a DTensor with like's mesh and placements when like is one."""
    if not _is_dtensor(like):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.to(like.to_local().device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _flatten_keys(msd: dict, osd: dict) -> set[str]:
    keys = {f"model/{fqn}" for fqn in msd}
    keys |= {f"optim/{fqn}/{k}" for fqn, st in osd["state"].items() for k in st}
    return keys
