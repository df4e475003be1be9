"""What a training run is asked to do (TrainOptions, checked by validate()) and its lr schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_anatomy.config import ConfigError
from llm_anatomy.train.identity import check_allowed

OPTIMIZERS = ("adamw", "ademamix")  # adamw first: the default, what users run
SCHEDULES = ("cosine", "constant")
STRATEGIES = ("auto", "none", "ddp", "fsdp")
PROGRESS = ("auto", "bar", "lines", "none")
PP_SCHEDULES = ("1f1b", "interleaved-1f1b")  # llm_anatomy.mesh_rules.SCHEDULES
MIN_LR_RATIO = 0.1  # cosine decays to 10% of --lr (nanoGPT's and Chinchilla's choice)


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm: the message is one line, for the CLI."""


@dataclass
class TrainOptions:
    steps: int = 200
    lr: float = 1e-3
    optimizer: str = "adamw"  # torch's AdamW, fused on CUDA; ademamix: llm_anatomy.optim (setup.make_optimizer)
    schedule: str = "cosine"
    warmup: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 4
    ckpt_dir: str | None = None
    ckpt_every: int | None = None  # None: every eval_every steps (and at the end)
    keep: int = 2
    resume: str | None = None  # "latest" (in ckpt_dir, if any) or a checkpoint path
    allow_changed: tuple[str, ...] = ()  # identity keys a resume may change (identity.py)
    seed: int = 0
    device: str | None = None  # None: cuda when present, else cpu
    strategy: str = "auto"  # auto: none in one process; ddp (baseline) / fsdp (efficient) under torchrun
    out: str | None = None  # train_log.json and loss.png; default: ckpt_dir, else runs/train
    log_every: int = 10
    progress: str = "auto"
    deterministic: bool = False
    plot: bool = True  # loss.png beside train_log.json (matplotlib, ~0.3 s)
    param_dtype: str | None = None  # API only: "float64" builds a float64 reference run
    tp: int = 1  # tensor-parallel degree (train/mesh.py): tp x dp = the world
    pp: int = 1  # pipeline ranks: pp x dp = the world
    pp_schedule: str = "1f1b"  # torch.distributed.pipelining's Schedule1F1B or ScheduleInterleaved1F1B
    microbatches: int | None = None  # per step and pipeline; None: pp

    def validate(self) -> None:
        for k in ("steps", "eval_batches", "log_every"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        for k in ("warmup", "eval_every", "keep", "seed"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{k.replace('_', '-')} must be an integer >= 0, got {v!r}")
        if self.ckpt_every is not None and (not isinstance(self.ckpt_every, int) or self.ckpt_every < 1):
            raise ConfigError(f"--ckpt-every must be a positive integer, got {self.ckpt_every!r}")
        for k in ("tp", "pp"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{k} must be a positive integer, got {v!r}")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ConfigError(f"--microbatches must be a positive integer, got {self.microbatches!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr!r}")
        # the update is lr × a normalised step (AdamW's about 1, AdEMAMix's up to 1 + alpha): an lr past the parameter
        # dtype's range overflows inside the optimizer, so it is refused here
        top = torch.finfo(torch.float64 if self.param_dtype == "float64" else torch.float32).max
        if self.lr > top:
            raise ConfigError(f"--lr {self.lr:g} overflows the parameters' dtype (its largest value is {top:.3g}); "
                              f"learning rates are of order 1e-4 to 1e-2")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"--grad-clip must be >= 0 (0: no clipping), got {self.grad_clip!r}")
        for k, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("strategy", STRATEGIES),
                           ("progress", PROGRESS), ("pp_schedule", PP_SCHEDULES)):
            if getattr(self, k) not in allowed:
                raise ConfigError(f"--{k.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, k)!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but this machine has no CUDA GPU")
        if self.resume not in (None, "latest") and not Path(self.resume).exists():
            raise ConfigError(f"--resume {self.resume}: no such checkpoint")
        check_allowed(tuple(self.allow_changed))
        if self.resume == "latest" and not self.ckpt_dir:
            raise ConfigError("--resume without a path needs --ckpt-dir (where to look for the latest checkpoint)")


def lr_at(step: int, o: TrainOptions) -> float:
    """Learning rate of 1-based step `step`: linear warm-up, then constant or cosine to MIN_LR_RATIO·lr."""
    if o.warmup and step <= o.warmup:
        return o.lr * step / o.warmup
    if o.schedule == "constant":
        return o.lr
    frac = (step - o.warmup) / max(1, o.steps - o.warmup)
    lo = o.lr * MIN_LR_RATIO
    return lo + 0.5 * (o.lr - lo) * (1 + math.cos(math.pi * min(1.0, frac)))
