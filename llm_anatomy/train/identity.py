"""A run's identity: everything that decides its trajectory, written into every checkpoint's trainer.json and
compared on --resume.

    config, variant, optimizer          the model and the update rule (another one cannot even load)
    run (batch, seq, dtype, recompute)  one rank's micro-batch and the dtype policy; param_dtype (float64 runs)
    lr, schedule, warmup                the lr at every step (options.lr_at)
    weight_decay, grad_clip             the update's decay and the gradient clipping
    optimizer_hparams                   the optimizer's own constants: betas, eps, AdEMAMix's alpha, ...
    seed, data_fingerprint, train_tokens  initial weights, data order, the data and its train/eval split
Left out, as documented changes of a resume: --steps (the schedule then spans the new count, and the resume
says so), the world size (any resumes any other) and what only reads the run (eval, checkpoints, display).

A resume whose identity differs refuses in one line listing each difference, unless --allow-changed names it
(a key, or a group such as `run` or `optimizer_hparams`); an allowed change is warned and kept in the log.
"""
from __future__ import annotations

import json

from llm_anatomy.config import ConfigError

KEYS = ("config", "run", "variant", "optimizer", "optimizer_hparams", "param_dtype", "lr", "schedule", "warmup",
        "weight_decay", "grad_clip", "seed", "data_fingerprint", "train_tokens")
# optimizer.defaults left out: lr and weight_decay (keys of their own), T_alpha_beta3 (follows --steps), and
# those that change only how a step runs, not where it goes
_NOT_HPARAMS = {"lr", "weight_decay", "T_alpha_beta3", "foreach", "fused", "capturable", "differentiable"}
ABSENT = "(not recorded)"


def optimizer_hparams(opt) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(opt.defaults.items())
            if k not in _NOT_HPARAMS and isinstance(v, (bool, int, float, str, tuple, type(None)))}


def identity(cfg, run, variant: str, o, data, opt) -> dict:
    return dict(config=cfg.to_dict(), run=run.to_dict(), variant=variant, optimizer=o.optimizer,
                optimizer_hparams=optimizer_hparams(opt), param_dtype=o.param_dtype, lr=o.lr, schedule=o.schedule,
                warmup=o.warmup, weight_decay=o.weight_decay, grad_clip=o.grad_clip, seed=o.seed,
                data_fingerprint=data.fingerprint, train_tokens=int(data.train.size))


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def differences(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, the checkpoint's value, this run's) for each leaf that differs; dotted keys inside groups."""
    a, b = (dict(_leaves(json.loads(json.dumps(d)))) for d in (saved, now))  # tuples as lists, as on disk
    return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(a.keys() | b.keys())
            if a.get(k, ABSENT) != b.get(k, ABSENT)]


def check_allowed(names: tuple[str, ...]) -> None:
    bad = [n for n in names if n.split(".")[0] not in KEYS]
    if bad:
        raise ConfigError(f"--allow-changed {','.join(bad)}: not part of a run's identity; choose from "
                          f"{', '.join(KEYS)} (or a key inside config, run or optimizer_hparams, e.g. run.batch)")


def allowed(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def describe(diffs: list[tuple[str, object, object]]) -> str:
    return "; ".join(f"{k} {was!r} -> {now!r}" for k, was, now in diffs)
