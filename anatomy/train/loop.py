"""The training loop: one process, or DDP (baseline) / FSDP2 (efficient) under torchrun.

Per step: batch (data.Batches, a function of the samples consumed) -> forward under the policy's
autocast -> backward -> gradient norm (clipped when --grad-clip > 0) -> finiteness check -> the
optimizer step at lr(step) -> record. The check comes before the optimizer step, so a NaN/inf loss
or gradient never reaches the weights: the run stops with Diverged and the last checkpoint on
disk is the last good state.

Why a resumed run repeats the uninterrupted one exactly: every input to step t is a function of
what the checkpoint holds. The weights and optimizer state are restored bit for bit (DCP), lr(t)
and AdEMAMix's alpha(t)/beta3(t) are functions of t, and the batch is a function of (seed,
samples consumed). On CPU the kernels are deterministic for fixed shapes and thread count; on
CUDA some backward kernels use atomics (see --deterministic).

Both variants start from the same weights for the same --seed: the efficient model loads the
baseline's initial state dict (its q/k/v and gate/up are fused, so its own init would draw the
same numbers in another layout).
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from anatomy.config import ConfigError, ModelConfig, Run
from anatomy.models import autocast_ctx, build_model, param_dtype
from anatomy.train import checkpoint as ckpt
from anatomy.train.data import Batches, TokenData
from anatomy.train.progress import Display, memory_str, peak_flops, stats_line

OPTIMIZERS = ("ademamix", "adamw")
SCHEDULES = ("cosine", "constant")
STRATEGIES = ("auto", "none", "ddp", "fsdp")
PROGRESS = ("auto", "bar", "lines", "none")
MIN_LR_RATIO = 0.1  # cosine decays to 10% of --lr (nanoGPT's and Chinchilla's choice)


class Diverged(RuntimeError):
    """A non-finite loss or gradient norm: the message is one line, for the CLI."""


@dataclass
class TrainOptions:
    steps: int = 200
    lr: float = 1e-3
    optimizer: str = "ademamix"
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
    seed: int = 0
    device: str | None = None  # None: cuda when present, else cpu
    strategy: str = "auto"  # auto: none in one process; ddp (baseline) / fsdp (efficient) under torchrun
    out: str | None = None  # train_log.json and loss.png; default: ckpt_dir, else runs/train
    log_every: int = 10
    progress: str = "auto"
    deterministic: bool = False
    plot: bool = True  # loss.png beside train_log.json (matplotlib, ~0.3 s)
    param_dtype: str | None = None  # API only: "float64" builds a float64 reference run

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
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"--grad-clip must be >= 0 (0: no clipping), got {self.grad_clip!r}")
        for k, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("strategy", STRATEGIES),
                           ("progress", PROGRESS)):
            if getattr(self, k) not in allowed:
                raise ConfigError(f"--{k} must be one of {', '.join(allowed)}, got {getattr(self, k)!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but this machine has no CUDA GPU")
        if self.resume not in (None, "latest") and not Path(self.resume).exists():
            raise ConfigError(f"--resume {self.resume}: no such checkpoint")
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


def init_model(cfg: ModelConfig, variant: str, device, dtype, seed: int, recompute: str = "none") -> torch.nn.Module:
    """The variant's model holding the baseline's initial weights for `seed` (same start for both);
    recompute is Run.recompute (the efficient variant's)."""
    base = build_model(cfg, "baseline", device=device, dtype=dtype, seed=seed)
    if variant == "baseline":
        return base
    model = build_model(cfg, variant, device=device, dtype=dtype, seed=seed, recompute=recompute)
    model.load_state_dict(base.state_dict())  # the efficient model's pre-hook fuses q/k/v and gate/up
    return model


def make_optimizer(name: str, variant: str, model: torch.nn.Module, o: TrainOptions, device: torch.device):
    """The optimizer pair: the baseline variant gets the readable per-parameter loop, the efficient one
    the foreach (compiled on CUDA) version. T_alpha_beta3 = --steps, the paper's choice."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "ademamix":
        from anatomy.optim import AdEMAMix, FusedAdEMAMix

        cls = AdEMAMix if variant == "baseline" else FusedAdEMAMix
        return cls(params, lr=o.lr, weight_decay=o.weight_decay, T_alpha_beta3=o.steps)
    if variant == "baseline":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, foreach=False)
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused, foreach=not fused)


# ---- distributed set-up -------------------------------------------------------------------------
@dataclass
class Placement:
    strategy: str  # none | ddp | fsdp
    device: torch.device
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # we initialised the process group, so we destroy it


def place(o: TrainOptions, variant: str) -> Placement:
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched else 1
    strategy = o.strategy
    if strategy == "auto":
        strategy = "none" if world == 1 else ("ddp" if variant == "baseline" else "fsdp")
    if strategy == "none" and world > 1:
        raise ConfigError(f"--strategy none under torchrun with {world} ranks: pick ddp or fsdp (or auto)")
    cuda = torch.cuda.is_available() and o.device != "cpu"
    if strategy == "none":
        return Placement("none", torch.device("cuda" if cuda else "cpu"))
    if not launched:
        raise ConfigError(f"--strategy {strategy} needs several processes: launch with "
                          f"torchrun --nproc_per_node N -m anatomy.cli train ...")
    try:
        from anatomy.distributed.strategies import init_distributed
    except ImportError as e:
        raise ConfigError(f"distributed training needs anatomy.distributed, which is unavailable: {e}") from None
    owns = not dist.is_initialized()
    init_distributed("nccl" if cuda else "gloo", 600.0)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Placement(strategy, device, dist.get_rank(), dist.get_world_size(), owns)


def _faults() -> dict[str, int]:
    """Test seam: ANATOMY_TRAIN_FAULT="kill-after-step:6,kill-in-save:8,nan-at-step:5" (SIGKILL ourselves
    after that step / inside that step's checkpoint save, before its commit; or poison that loss)."""
    out = {}
    for item in filter(None, os.environ.get("ANATOMY_TRAIN_FAULT", "").split(",")):
        k, _, v = item.partition(":")
        out[k.strip()] = int(v)
    return out


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _global_mean(x: torch.Tensor, pl: Placement) -> float:
    x = x.detach().to(pl.device, torch.float64).reshape(1).clone()  # exact for an fp32 loss
    if pl.world > 1:
        dist.all_reduce(x)
        x /= pl.world
    return float(x.item())


@torch.no_grad()
def evaluate(model, batches: Batches, n: int, run: Run, device: torch.device, amp: bool, pl: Placement) -> float:
    """Mean loss over the first n global eval batches of B·world windows, sharded over ranks as the
    training batches are: the same eval set as one process with batch B·world."""
    was = model.training
    model.eval()
    tot = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        x, y = batches.get((i * pl.world + pl.rank) * batches.batch, device)
        with autocast_ctx(run, device.type) if amp else contextlib.nullcontext():
            tot += model(x, y).detach().double().cpu()
    model.train(was)
    return _global_mean(tot / n, pl)


# ---- the loop -----------------------------------------------------------------------------------
def train(cfg: ModelConfig, run: Run, variant: str, data: TokenData, o: TrainOptions, *, loss_hook=None,
          display: Display | None = None) -> dict:
    """Train and return a summary dict (see docs/training.md). Raises ConfigError on bad input and
    Diverged on a non-finite loss; both leave the last good checkpoint in place."""
    o.validate()
    faults = _faults()
    if o.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    pl = place(o, variant)
    try:
        return _train(cfg, run, variant, data, o, pl, faults, loss_hook, display)
    finally:
        if pl.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg, run, variant, data, o, pl: Placement, faults, loss_hook, display) -> dict:
    from anatomy.train import report

    dev = pl.device
    dtype = torch.float64 if o.param_dtype == "float64" else param_dtype(run)
    torch.manual_seed(o.seed)
    model = init_model(cfg, variant, dev, dtype, o.seed, run.recompute)  # the same weights on every rank
    amp = True
    if pl.strategy == "ddp":
        from anatomy.distributed.strategies import wrap

        model = wrap(model, "ddp", device_ids=[dev.index] if dev.type == "cuda" else None)
    elif pl.strategy == "fsdp":
        from anatomy.distributed.strategies import default_mixed_precision, wrap

        pd, rd = default_mixed_precision(run)
        model = wrap(model, "fsdp", param_dtype=pd, reduce_dtype=rd)
        amp = False  # FSDP's MixedPrecisionPolicy is its amp: no autocast on top
    opt = make_optimizer(o.optimizer, variant, model, o, dev)

    B, S = run.batch, run.seq
    train_b = Batches(data.train, B, S, o.seed)
    eval_b = Batches(data.eval, B, S, o.seed, shuffle=False)
    n_eval = min(o.eval_batches, -(-eval_b.windows // (B * pl.world)))
    identity = dict(config=cfg.to_dict(), run=run.to_dict(), variant=variant, optimizer=o.optimizer, seed=o.seed,
                    data_fingerprint=data.fingerprint)
    hist: dict = dict(loss=[], lr=[], tokens_per_s=[], eval=[])
    start, consumed, resumed_from = 0, 0, None

    ck_path = None
    note = ""
    if o.resume == "latest":
        ck_path = ckpt.latest(o.ckpt_dir)
        note = "" if ck_path else f" · no checkpoint in {o.ckpt_dir} yet: starting at step 0"
    elif o.resume:
        ck_path = ckpt.resolve(o.resume)
    if ck_path is not None:
        tr = ckpt.load(ck_path, model, opt)
        for k, v in identity.items():
            if tr["identity"].get(k) != v:
                raise ConfigError(f"checkpoint {ck_path} was written with another {k} "
                                  f"({tr['identity'].get(k)!r}); this run has {v!r}")
        start, consumed, hist, resumed_from = tr["step"], tr["consumed"], tr["history"], str(ck_path)
        if start >= o.steps:
            note = f" · it is at step {start} >= --steps {o.steps}: nothing to train"
        elif tr["steps"] != o.steps:
            note = (f" · it was written by a {tr['steps']}-step run: the lr schedule and AdEMAMix's warm-up now "
                    f"span {o.steps} steps")

    out = Path(o.out or o.ckpt_dir or "runs/train")
    ckpt_every = o.ckpt_every or o.eval_every or o.steps
    flops = _model_flops(cfg, run, variant, dev)
    peak = peak_flops(dev, run.dtype)
    disp = display or Display(o.progress, o.steps, start, o.log_every, pl.rank)
    summary = dict(status="running", strategy=pl.strategy, world=pl.world, device=str(dev),
                   start_step=start, resumed_from=resumed_from, checkpoint=None, flops_per_step=flops,
                   peak_flops=peak, data=data.describe(), options=asdict(o), **identity)
    n_params = sum(p.numel() for p in model.parameters())  # a DTensor reports its global numel
    disp.print(f"{cfg.name} · {variant} · {n_params / 1e6:.2f} M params · B={B} S={S} {run.dtype} · "
               f"{o.optimizer} lr {o.lr:g} · {pl.strategy} on {pl.world} × {dev.type} · data: {data.source}"
               + (f" · resumed at step {start} from {ck_path}" if ck_path else "") + note)
    if data.tokenizer:
        t = data.tokenizer
        disp.print(f"tokenizer: BPE {t['vocab_size']:,} tokens ({'cached' if t['cache_hit'] else 'trained now'}, "
                   f"{t['path']})")

    def trainer_state(step: int) -> dict:
        return dict(step=step, consumed=consumed, position=train_b.position(consumed), history=hist,
                    identity=identity, steps=o.steps, variant=variant, config=cfg.to_dict())

    def save(step: int) -> None:
        kill = (lambda _: _kill()) if faults.get("kill-in-save") == step else None
        summary["checkpoint"] = str(ckpt.save(o.ckpt_dir, step, model, opt, trainer_state(step), keep=o.keep,
                                              before_commit=kill))

    params = [p for p in model.parameters() if p.requires_grad]
    clip = o.grad_clip if o.grad_clip > 0 else float("inf")
    window: collections.deque[float] = collections.deque(maxlen=10)
    model.train()
    try:
        for step in range(start + 1, o.steps + 1):
            t0 = time.perf_counter()
            x, y = train_b.get(consumed + pl.rank * B, dev)
            lr = lr_at(step, o)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast_ctx(run, dev.type) if amp else contextlib.nullcontext():
                loss = model(x, y)
            if loss_hook is not None:
                loss = loss_hook(step, loss)
            if faults.get("nan-at-step") == step:
                loss = loss * float("nan")
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, clip)
            gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
            lval = _global_mean(loss, pl)
            if not (math.isfinite(lval) and math.isfinite(gnorm)):
                what = f"loss is {lval}" if not math.isfinite(lval) else f"gradient norm is {gnorm}"
                last = ckpt.latest(o.ckpt_dir) if o.ckpt_dir else None
                keep = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
                raise Diverged(f"{what} at step {step} (lr {lr:.3g}); stopped before the update, {keep}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            consumed += B * pl.world
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            hist["loss"].append(lval)
            hist["lr"].append(lr)
            hist["tokens_per_s"].append(B * S * pl.world / dt)
            window.append(dt)  # shown: the mean over the last 10 steps (one step's time is noisy)
            mean_dt = sum(window) / len(window)
            mfu = flops / mean_dt / peak if (flops and peak) else None
            disp.step(step, stats_line(lval, lr, B * S * pl.world / mean_dt, mfu, memory_str(dev)))
            if (o.eval_every and step % o.eval_every == 0) or step == o.steps:
                ev = evaluate(model, eval_b, n_eval, run, dev, amp, pl)
                hist["eval"].append([step, ev])
                disp.print(f"step {step}: eval loss {ev:.4f} ({n_eval} batches)")
            if o.ckpt_dir and (step % ckpt_every == 0 or step == o.steps):
                save(step)
            if faults.get("kill-after-step") == step:
                _kill()
        summary["status"] = "finished"
    except Diverged:
        summary["status"] = "diverged"
        raise
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    finally:
        disp.close()
        summary.update(steps_done=len(hist["loss"]), history=hist)
        if pl.rank == 0 and hist["loss"]:
            summary.update(report.write(out, summary, plot_png=o.plot))
    last = hist["loss"][-1] if hist["loss"] else None
    ev = hist["eval"][-1][1] if hist["eval"] else None
    if pl.rank == 0 and last is not None:
        disp.print(f"done: {len(hist['loss'])} steps, loss {last:.4f}" + (f", eval {ev:.4f}" if ev is not None else "")
                   + f" · log {summary.get('log')} · plot {summary.get('plot')}"
                   + (f" · checkpoint {summary['checkpoint']}" if summary["checkpoint"] else ""))
    return summary


def _model_flops(cfg: ModelConfig, run: Run, variant: str, dev: torch.device) -> int | None:
    """Model-convention FLOPs of one step on one rank (forward + backward), from the calculator."""
    try:
        from anatomy.calculator import estimate

        f = estimate(cfg, run, variant, device="cuda" if dev.type == "cuda" else "cpu").to_dict()["flops"]["model"]
        return int(f["forward"] + f["backward"])
    except (ConfigError, KeyError, ImportError):
        return None
