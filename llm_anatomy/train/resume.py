"""Where a resumed run starts: the newest intact checkpoint, checked before it is loaded.

--resume            the run directory is --ckpt-dir; start from its `latest` pointer's checkpoint
--resume DIR        the run directory is DIR; the same
--resume DIR/step-N the run directory is DIR; start from step N
A damaged candidate is reported in one line and the next older one is tried (manifest.find); when
checkpoints exist and none is intact, the run stops with one line (ConfigError, exit 2). A
--resume with an empty --ckpt-dir starts at step 0. A checkpoint whose identity (identity.py) differs
from this run's is refused in one line listing the differences, unless --allow-changed names each one;
an allowed change is warned and recorded in the run's log. Rank 0 chooses and every rank loads the same
folder, re-checking each file's sha256 as it reads it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llm_anatomy.config import ConfigError
from llm_anatomy.train import checkpoint as ckpt
from llm_anatomy.train import identity as ident
from llm_anatomy.train import manifest as mf
from llm_anatomy.train import ranks
from llm_anatomy.train.options import TrainOptions

_ERROR = -2  # broadcast from rank 0 when it refused: every rank stops


@dataclass
class Start:
    step: int = 0
    consumed: int = 0
    history: dict = field(default_factory=lambda: dict(loss=[], lr=[], tokens_per_s=[], grad_norm=[], eval=[]))
    path: Path | None = None
    note: str = ""
    changed: list = field(default_factory=list)  # identity keys this resume changed, as --allow-changed let it


def run_dir(o: TrainOptions) -> Path:
    p = Path(o.ckpt_dir if o.resume == "latest" else o.resume)
    return p.parent if mf.step_of(p) is not None else p


def _preference(o: TrainOptions, d: Path) -> Path | None:
    asked = Path(o.resume) if o.resume != "latest" else None
    return asked if asked is not None and mf.step_of(asked) is not None else mf.read_latest(d)


def latest(run_dir: str | Path, warn: Callable[[str], None] = lambda _: None) -> Path | None:
    """The newest intact checkpoint the run directory's `latest` pointer leads to (or an older one)."""
    d = Path(run_dir)
    return mf.find(d, mf.read_latest(d), warn)[0]


def _choose(o: TrainOptions, warn: Callable[[str], None]) -> tuple[Path | None, str]:
    d = run_dir(o)
    damaged: list[str] = []
    found, _ = mf.find(d, _preference(o, d), damaged.append)
    if found is not None:
        for line in damaged:  # one line per checkpoint passed over
            warn(f"{line}; skipped, resuming from the older {found.name}")
        return found, ""
    if damaged:
        raise ConfigError(f"no intact checkpoint in {d} ({len(damaged)} damaged; the newest: {damaged[0]})")
    if o.resume != "latest":
        raise ConfigError(f"--resume {o.resume}: no checkpoint there (a step-NNNNNNNN folder with a manifest.json)")
    return None, f" · no checkpoint in {d} yet: starting at step 0"


def resume(o: TrainOptions, model, opt, identity: dict, warn: Callable[[str], None], *,
           layout: str | None = None) -> Start:
    """The step, data position and history to start from, with model and optimizer loaded (every rank).
    layout: the run's mesh (train.mesh.layout); a checkpoint written on another one is refused."""
    if not o.resume:
        return Start()
    found, note, error = None, "", None
    if ranks.rank() == 0:
        try:
            found, note = _choose(o, warn)
        except ConfigError as e:
            error = e
    step = ranks.from_rank0(_ERROR if error else (mf.step_of(found) if found else -1))
    if step == _ERROR:
        raise error or ConfigError("rank 0 refused the checkpoint (its message says why)")
    if step < 0:
        return Start(note=note)
    folder = ckpt.step_dir(run_dir(o), step)
    tr = ckpt.load(folder, model, opt, layout=layout)
    diffs = ident.differences(tr["identity"], identity)
    refused = [d for d in diffs if not ident.allowed(d[0], tuple(o.allow_changed))]
    if refused:
        raise ConfigError(f"checkpoint {folder} was written by another run ({ident.describe(refused)}): resume with "
                          f"its options, or pass --allow-changed {','.join(k for k, _, _ in refused)} if the change "
                          f"is deliberate")
    for k, was, now in diffs:
        warn(f"resuming {folder} with {k} changed from {was!r} to {now!r} (--allow-changed); the run's log keeps it")
    start = Start(tr["step"], tr["consumed"], tr["history"], folder,
                  changed=[dict(key=k, checkpoint=was, now=now) for k, was, now in diffs])
    if start.step >= o.steps:
        start.note = f" · it is at step {start.step} >= --steps {o.steps}: nothing to train"
    elif tr["steps"] != o.steps:
        start.note = (f" · it was written by a {tr['steps']}-step run: the lr schedule and AdEMAMix's warm-up now "
                      f"span {o.steps} steps")
    return start
