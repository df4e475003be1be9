"""The training loop: one process, or DDP (baseline) / FSDP2 (efficient) under torchrun, or a tensor- or
pipeline-parallel mesh (--tp / --pp, train/mesh.py: the step runs through the mesh's engine).

Per step: batch (data.Batches, a function of the samples consumed) -> forward under the policy's
autocast -> backward -> gradient norm (clipped when --grad-clip > 0) -> finiteness check -> the
optimizer step at lr(step) -> record. The check comes before the optimizer step, so a NaN/inf loss
or gradient never reaches the weights: the run stops with Diverged and the last checkpoint on
disk is the last good state.

Why a resumed run repeats the uninterrupted one exactly: every input to step t is a function of
what the checkpoint holds. The weights and optimizer state are restored bit for bit, lr(t) and
AdEMAMix's alpha(t)/beta3(t) are functions of t, and the batch is a function of (seed, samples
consumed). On CPU the kernels are deterministic for fixed shapes and thread count; on CUDA some
backward kernels use atomics (see --deterministic).

The run directory (--ckpt-dir) belongs to one run at a time (lock.py); --keep prunes only the
checkpoints this run wrote.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.models import autocast_ctx
from llm_anatomy.train import checkpoint as ckpt
from llm_anatomy.train import mesh, ranks
from llm_anatomy.train.data import Batches, TokenData
from llm_anatomy.train.identity import identity
from llm_anatomy.train.lock import RunLock
from llm_anatomy.train.options import (OPTIMIZERS, PROGRESS, SCHEDULES, STRATEGIES, Diverged,  # noqa: F401 (re-exported)
                                   TrainOptions, lr_at)
from llm_anatomy.train.progress import Display, memory_str, peak_flops, stats_line
from llm_anatomy.train.resume import Start, resume
from llm_anatomy.train.setup import (Placement, build, init_model, launched_world, make_optimizer,  # noqa: F401
                                     model_flops, place)

COLLAPSE_RTOL = 1e-5  # a loss this close to ln(vocab) after the first steps: the model predicts the uniform law


def train(cfg: ModelConfig, run: Run, variant: str, data: TokenData, o: TrainOptions, *, loss_hook=None,
          display: Display | None = None) -> dict:
    """Train and return a summary dict (see docs/training.md). Raises ConfigError on bad input and
    Diverged on a non-finite loss; both leave the last good checkpoint in place."""
    o.validate()
    mesh.check(cfg, run, variant, o, launched_world())
    if o.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    pl = place(o, variant)
    try:
        with _locked(o.ckpt_dir, pl):
            summary = Trainer(cfg, run, variant, data, o, pl, loss_hook).run(display)
        if pl.owns_group:
            # no rank closes its sockets while a peer still works (rank 0 writes the log and plot last):
            # every rank reaches the teardown together
            dist.barrier()
        return summary
    finally:
        if pl.owns_group and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _locked(folder: str | None, pl: Placement):
    """Rank 0 holds the run directory's lock for the whole run; every rank stops if it is refused."""
    lock = RunLock(folder) if folder and pl.rank == 0 else None
    refused = None
    if lock is not None:
        try:
            lock.acquire()
        except ConfigError as e:
            refused = e
    if ranks.max_int(int(refused is not None)):
        raise refused or ConfigError(f"{folder} is in use by another run (rank 0's message says by whom)")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def warn(msg: str) -> None:
    if ranks.rank() == 0:
        print(f"anatomy train: warning: {' '.join(msg.split())}", file=sys.stderr, flush=True)


def _faults() -> dict[str, int]:
    """Test seam: ANATOMY_TRAIN_FAULT="kill-after-step:6,kill-in-save:8,nan-at-step:5" (SIGKILL ourselves
    after that step / inside that step's checkpoint save, before its commit; or poison that loss)."""
    out = {}
    for item in filter(None, os.environ.get("ANATOMY_TRAIN_FAULT", "").split(",")):
        k, _, v = item.partition(":")
        out[k.strip()] = int(v)
    return out


def _kill(*_) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _global_mean(x: torch.Tensor, pl: Placement) -> float:
    """The mean over the ranks holding a copy of the loss (pl.loss_ranks; the others add 0)."""
    if hasattr(x, "full_tensor"):  # a loss_parallel loss: a DTensor replicated over tp
        x = x.full_tensor()
    x = x.detach().to(pl.device, torch.float64).reshape(1).clone()  # exact for an fp32 loss
    if pl.world > 1:
        dist.all_reduce(x)
        x /= pl.loss_ranks
    return float(x.item())


def _per_gpu(flops: int | None, o: TrainOptions) -> int | None:
    """One rank's share of its dp group's model FLOPs: TP and PP split a batch's work over tp x pp ranks (MFU's
    convention: the model's FLOPs over every GPU that ran them)."""
    return flops // (o.tp * o.pp) if flops else flops


@dataclass
class Trainer:
    cfg: ModelConfig
    run_: Run
    variant: str
    data: TokenData
    o: TrainOptions
    pl: Placement
    loss_hook: object = None
    faults: dict = field(default_factory=_faults)
    written: list = field(default_factory=list)  # the checkpoints this run committed, oldest first

    def __post_init__(self):
        B, S = self.run_.batch, self.run_.seq
        self.model, self.opt, self.amp = build(self.cfg, self.run_, self.variant, self.o, self.pl)
        if self.loss_hook is not None and isinstance(self.model, mesh.Pipelined):
            raise ConfigError("loss_hook sees the loss before backward; a pipeline's backward runs inside its schedule")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.train_b = Batches(self.data.train, B, S, self.o.seed)
        self.eval_b = Batches(self.data.eval, B, S, self.o.seed, shuffle=False)
        self.n_eval = min(self.o.eval_batches, -(-self.eval_b.windows // (B * self.pl.dp)))
        self.identity = identity(self.cfg, self.run_, self.variant, self.o, self.data, self.opt)

    # ---- the run, top to bottom ---------------------------------------------------------------------
    def run(self, display: Display | None) -> dict:
        from llm_anatomy.train import report

        start = resume(self.o, self.model, self.opt, self.identity, warn, layout=self.pl.layout)
        self.consumed, self.hist = start.consumed, start.history
        self.summary = self._summary(start)
        self.summary["changed_on_resume"] = start.changed
        self.disp = display or Display(self.o.progress, self.o.steps, start.step, self.o.log_every, self.pl.rank)
        self._announce(start)
        self.model.train()
        try:
            for step in range(start.step + 1, self.o.steps + 1):
                self.step(step, first=step == start.step + 1)
                self.after_step(step)
            self.summary["status"] = "finished"
        except Diverged:
            self.summary["status"] = "diverged"
            raise
        except KeyboardInterrupt:
            self.summary["status"] = "interrupted"
            raise
        except BaseException:
            self.summary["status"] = "failed"
            raise
        finally:
            self.disp.close()
            self.summary.update(steps_done=len(self.hist["loss"]), history=self.hist)
            if self.pl.rank == 0 and self.hist["loss"]:
                out = Path(self.o.out or self.o.ckpt_dir or "runs/train")
                try:
                    self.summary.update(report.write(out, self.summary, plot_png=self.o.plot))
                except ckpt.StorageError:
                    if self.summary["status"] == "finished":
                        raise
                    # the run already stops for its own reason (a full disk, most often): that is the line said
        self._farewell()
        return self.summary

    def step(self, step: int, first: bool) -> None:
        """One optimizer step; Diverged before the update when the loss or gradient is not finite."""
        B, pl = self.run_.batch, self.pl
        t0 = time.perf_counter()
        x, y = self.train_b.get(self.consumed + pl.dp_rank * B, pl.device)
        lr = lr_at(step, self.o)
        for g in self.opt.param_groups:
            g["lr"] = lr
        clip = self.o.grad_clip if self.o.grad_clip > 0 else float("inf")
        if isinstance(self.model, mesh.Pipelined):  # the schedule runs the forwards and backwards
            loss = self.model.run_schedule(x, y, backward=True)
            if self.faults.get("nan-at-step") == step:
                loss = loss * float("nan")
            gnorm = self.model.clip(self.params, clip)
        else:
            with self._forward_ctx():
                loss = self.model(x, y)
                if self.loss_hook is not None:
                    loss = self.loss_hook(step, loss)
                if self.faults.get("nan-at-step") == step:
                    loss = loss * float("nan")
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        lval = _global_mean(loss, pl)
        if not (math.isfinite(lval) and math.isfinite(gnorm)):
            what = f"loss is {lval}" if not math.isfinite(lval) else f"gradient norm is {gnorm}"
            last = self.written[-1] if self.written else self.summary.get("resumed_from")
            keep = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
            raise Diverged(f"{what} at step {step} (lr {lr:.3g}); stopped before the update, {keep}")
        self._update(step, lr, first)
        self.consumed += B * pl.dp
        if pl.device.type == "cuda":
            torch.cuda.synchronize(pl.device)
        self._record(step, lval, lr, time.perf_counter() - t0, gnorm)

    def _forward_ctx(self) -> contextlib.ExitStack:
        """The forward's (and under TP the backward's) context: the dtype policy's autocast, loss_parallel on TP."""
        stack = contextlib.ExitStack()
        if self.amp:
            stack.enter_context(autocast_ctx(self.run_, self.pl.device.type))
        if self.pl.strategy == "tp":
            from llm_anatomy.distributed.tensor_parallel import loss_context

            stack.enter_context(loss_context(self.o.tp))
        return stack

    def _update(self, step: int, lr: float, first: bool) -> None:
        """The optimizer step. The first one of the process is checked: an lr whose update overflows the
        weights is bad input (one line, exit 2), found before any checkpoint holds such weights."""
        try:
            self.opt.step()
        except RuntimeError as e:
            if "overflow" not in str(e):
                raise
            raise ConfigError(f"--lr {self.o.lr:g} overflows the optimizer's update at step {step}: "
                              f"{str(e).splitlines()[0][:120]}") from None
        self.opt.zero_grad(set_to_none=True)
        if first:
            local = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]  # this rank's shard
            bad = any(not bool(torch.isfinite(p.detach()).all()) for p in local)
            if ranks.max_int(int(bad)):
                raise ConfigError(f"--lr {self.o.lr:g} makes the first update non-finite (step {step}, lr {lr:.3g}): "
                                  f"the weights overflow; learning rates are of order 1e-4 to 1e-2")

    def _record(self, step: int, lval: float, lr: float, dt: float, gnorm: float) -> None:
        tokens = self.run_.batch * self.run_.seq * self.pl.dp
        self.hist["loss"].append(lval)
        self.hist["lr"].append(lr)
        # the norm before clipping; a checkpoint written before grad_norm was recorded has none for its steps
        self.hist.setdefault("grad_norm", [None] * (len(self.hist["loss"]) - 1)).append(gnorm)
        self.hist["tokens_per_s"].append(tokens / dt)
        self.window.append(dt)  # shown: the mean over the last 10 steps (one step's time is noisy)
        mean_dt = sum(self.window) / len(self.window)
        flops, peak = self.summary["flops_per_step"], self.summary["peak_flops"]
        mfu = flops / mean_dt / peak if (flops and peak) else None
        self.disp.step(step, stats_line(lval, lr, tokens / mean_dt, mfu, memory_str(self.pl.device)))
        uniform = math.log(self.cfg.vocab)
        if step > 1 and not self.collapsed and abs(lval - uniform) <= COLLAPSE_RTOL * uniform:
            self.collapsed = True
            warn(f"the loss is ln(vocab) = {uniform:.6f} at step {step}: the model predicts every token with "
                 f"probability 1/{self.cfg.vocab} (collapsed; is --lr {self.o.lr:g} too high?)")

    def after_step(self, step: int) -> None:
        o = self.o
        if (o.eval_every and step % o.eval_every == 0) or step == o.steps:
            ev = self.evaluate()
            self.hist["eval"].append([step, ev])
            self.disp.print(f"step {step}: eval loss {ev:.4f} ({self.n_eval} batches)")
        every = o.ckpt_every or o.eval_every or o.steps
        if o.ckpt_dir and (step % every == 0 or step == o.steps):
            self.save(step)
        if self.faults.get("kill-after-step") == step:
            _kill()

    def save(self, step: int) -> None:
        kill = _kill if self.faults.get("kill-in-save") == step else None
        trainer = dict(step=step, consumed=self.consumed, position=self.train_b.position(self.consumed),
                       history=self.hist, identity=self.identity, steps=self.o.steps, variant=self.variant,
                       config=self.cfg.to_dict(), layout=self.pl.layout)
        path = ckpt.save(self.o.ckpt_dir, step, self.model, self.opt, trainer, before_commit=kill,
                         per_rank=self.pl.layout is not None)
        self.written = ckpt.prune([p for p in self.written if p != path] + [path], self.o.keep)
        self.summary["checkpoint"] = str(path)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first n global eval batches of B·dp windows, sharded over dp ranks as the
        training batches are: the same eval set as one process with batch B·dp."""
        pl, model = self.pl, self.model
        was = model.training
        model.eval()
        tot = torch.zeros((), dtype=torch.float64)
        for i in range(self.n_eval):
            x, y = self.eval_b.get((i * pl.dp + pl.dp_rank) * self.eval_b.batch, pl.device)
            if isinstance(model, mesh.Pipelined):
                tot += model.run_schedule(x, y, backward=False).cpu()
                continue
            with self._forward_ctx():
                loss = model(x, y)
                tot += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().double().cpu()
        model.train(was)
        return _global_mean(tot / self.n_eval, pl)

    # ---- what the run says ----------------------------------------------------------------------------
    def _summary(self, start: Start) -> dict:
        self.window: collections.deque[float] = collections.deque(maxlen=10)
        self.collapsed = False
        dev = self.pl.device
        return dict(status="running", strategy=self.pl.strategy, world=self.pl.world, mesh=self.pl.layout,
                    device=str(dev),
                    start_step=start.step, resumed_from=str(start.path) if start.path else None, checkpoint=None,
                    flops_per_step=_per_gpu(model_flops(self.cfg, self.run_, self.variant, dev), self.o),
                    peak_flops=peak_flops(dev, self.run_.dtype), data=self.data.describe(), options=asdict(self.o),
                    **self.identity)

    def _announce(self, start: Start) -> None:
        o, r, pl = self.o, self.run_, self.pl
        n_params = getattr(self.model, "n_params", None) or sum(p.numel() for p in self.model.parameters())
        # (a DTensor reports its global numel; a pipeline rank counts the stages of every rank)
        lean = " (lean block)" if self.variant == "efficient" and r.lean_block else ""
        self.disp.print(f"{self.cfg.name} · {self.variant}{lean} · {n_params / 1e6:.2f} M params · B={r.batch} S={r.seq} "
                        f"{r.dtype} · {o.optimizer} lr {o.lr:g} · {pl.layout or pl.strategy} on {pl.world} × {pl.device.type} · "
                        f"data: {self.data.source}"
                        + (f" · resumed at step {start.step} from {start.path}" if start.path else "") + start.note)
        if self.data.tokenizer:
            t = self.data.tokenizer
            self.disp.print(f"tokenizer: BPE {t['vocab_size']:,} tokens "
                            f"({'cached' if t['cache_hit'] else 'trained now'}, {t['path']})")

    def _farewell(self) -> None:
        h, s = self.hist, self.summary
        if self.pl.rank != 0 or not h["loss"]:
            return
        ev = h["eval"][-1][1] if h["eval"] else None
        self.disp.print(f"done: {len(h['loss'])} steps, loss {h['loss'][-1]:.4f}"
                        + (f", eval {ev:.4f}" if ev is not None else "")
                        + f" · log {s.get('log')} · plot {s.get('plot')}"
                        + (f" · checkpoint {s['checkpoint']}" if s["checkpoint"] else ""))
