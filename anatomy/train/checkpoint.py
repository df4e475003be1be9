"""Checkpoints: torch.distributed.checkpoint (DCP), committed atomically.

A checkpoint is a DCP folder <ckpt-dir>/step-<8 digits>/ holding
    model     get_state_dict's model half: plain tensors in one process, DTensor shards under FSDP2
              (each rank writes only its shard; DCP reshards on load, so a different world size resumes)
    optim     the optimizer state under parameter names (the same for AdEMAMix and FusedAdEMAMix)
    trainer   a JSON string: step, data position (samples consumed), the loss history, the config
    rng       one pickled entry per rank: python, torch CPU and CUDA generator states
and meta.json (step and loss, for humans; never read back).

Why atomic, and how. DCP writes many files (one or more per rank, then `.metadata`); a job killed in
the middle leaves a folder that looks like a checkpoint and is not. So every save goes to
`.tmp-step-N/` first; only when DCP has finished on every rank (and fsynced its files) does rank 0
rename it to `step-N/` (a rename within one folder is atomic on POSIX) and then replace the
`latest` pointer file (write `latest.tmp`, rename). A kill at any point leaves either the old
`latest` pointing at a complete checkpoint, or the new one: never a half-written one. Stale
`.tmp-*` folders are swept at the next save; the `keep` newest checkpoints are kept.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from anatomy.config import ConfigError

LATEST = "latest"
PREFIX = "step-"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"{PREFIX}{step:08d}"


def _complete(p: Path) -> bool:
    return (p / ".metadata").is_file()


def _step_of(p: Path) -> int:
    return int(p.name[len(PREFIX):])


def checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ckpt_dir, oldest first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit() and _complete(p)),
                  key=_step_of)


def latest(ckpt_dir: str | Path) -> Path | None:
    """The `latest` pointer's checkpoint if it is complete, else the newest complete one, else None."""
    d = Path(ckpt_dir)
    ptr = d / LATEST
    if ptr.is_file():
        p = d / ptr.read_text().strip()
        if _complete(p):
            return p
    found = checkpoints(d)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a ckpt-dir whose latest checkpoint is meant; ConfigError if neither."""
    p = Path(path)
    if _complete(p):
        return p
    found = latest(p)
    if found is None:
        raise ConfigError(f"no complete checkpoint at {p}")
    return found


# ---- RNG ----------------------------------------------------------------------------------------
def rng_state() -> bytes:
    st = dict(python=random.getstate(), torch=torch.get_rng_state().numpy().tobytes(), cuda=None)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return pickle.dumps(st)


def set_rng_state(blob: bytes) -> None:
    st = pickle.loads(blob)
    random.setstate(st["python"])
    torch.set_rng_state(torch.frombuffer(bytearray(st["torch"]), dtype=torch.uint8))
    if st["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(st["cuda"]), dtype=torch.uint8))


# ---- save / load ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    """DCP warns that it assumes one process when no process group exists: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         trainer: dict, *, keep: int = 2, before_commit: Callable[[Path], None] | None = None) -> Path:
    """Save on every rank (a collective under torchrun); returns the committed folder.

    before_commit(tmp) runs on rank 0 after DCP has finished and before the rename (a test seam)."""
    d = Path(ckpt_dir)
    final, tmp = step_dir(d, step), d / f".tmp-{PREFIX}{step:08d}"
    rank = _rank()
    if rank == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot write checkpoints to {d}: {e.strerror or e}") from None
        for stale in d.glob(f".tmp-{PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    msd, osd = get_state_dict(model, optimizer)
    state = dict(model=msd, optim=osd, trainer=json.dumps(trainer), rng={f"rank{rank}": rng_state()})
    with _quiet():  # ends with .metadata, written by the coordinator once every rank has written
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    if rank == 0:
        meta = dict(step=step, loss=(trainer.get("history", {}).get("loss") or [None])[-1],
                    variant=trainer.get("variant"), config=trainer.get("config"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if before_commit is not None:
            before_commit(tmp)
        old = None
        if final.exists():  # re-saving a step (a run resumed from an older checkpoint): swap it out
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(d)
        _write_atomic(d / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for p in checkpoints(d)[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint into model and optimizer in place (every rank); returns the trainer dict.

    The RNG state of this rank is restored when the checkpoint has one for it."""
    p = resolve(path)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(p)).read_metadata().state_dict_metadata
    rank = _rank()
    msd, osd = get_state_dict(model, optimizer)  # a fresh optimizer's state is created (lr=0 step)
    state = dict(model=msd, optim=osd, trainer="")
    if f"rng.rank{rank}" in keys:
        state["rng"] = {f"rank{rank}": b""}
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(p), no_dist=not dist.is_initialized())
    except Exception as e:  # a checkpoint of another model or optimizer: say so in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load checkpoint {p} into this model and optimizer: {first[:300]}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "rng" in state:
        set_rng_state(state["rng"][f"rank{rank}"])
    trainer = json.loads(state["trainer"])
    trainer["path"] = str(p)
    return trainer
