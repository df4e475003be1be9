"""`anatomy train`: train the baseline or the efficient model on your text, a token .bin, a saved
Hugging Face dataset, or the embedded default corpus; one process, or DDP/FSDP2 under torchrun.

    anatomy train --hidden 128 --layers 2 --heads 4 --intermediate 344 --vocab 2048 \\
        --batch 8 --seq 128 --steps 50 --dtype fp32 --device cpu --ckpt-dir runs/tiny
    torchrun --nproc_per_node 2 -m llm_anatomy.cli train --variant efficient ...   # FSDP2 (DDP for baseline)
    torchrun --nproc_per_node 4 -m llm_anatomy.cli train --variant baseline --tp 2 ...   # TP 2 x FSDP 2
    torchrun --nproc_per_node 2 -m llm_anatomy.cli train --pp 2 --pp-schedule 1f1b --microbatches 4 ...

Exit codes: 0 done; 2 bad input (one line on stderr); 3 the loss or gradient went NaN/inf (the
last good checkpoint is kept); 130 interrupted. A full disk, a damaged checkpoint with no intact
one to fall back on, a run directory in use: one line, exit 2. See docs/training.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from llm_anatomy.config import ConfigError

PROG = "anatomy train"
EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INTERRUPTED = 2, 3, 130
_EXTRA = ("safetensors", "tokenizers")  # the `train` extra of pyproject.toml


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def parser() -> argparse.ArgumentParser:
    from llm_anatomy.cli_args import HelpFormatter, add_config_flags as _add_config_flags
    from llm_anatomy.train.loop import OPTIMIZERS, PROGRESS, SCHEDULES, STRATEGIES, TrainOptions

    class Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
        """The epilog's examples as written; each flag's default after its help."""

    d = TrainOptions()
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                epilog=__doc__.split("\n\n", 1)[1], formatter_class=Formatter)
    _add_config_flags(p)  # --preset/--hf-config/fields, --batch --seq --dtype --variant, --json
    p.set_defaults(batch=8, seq=256)  # per rank; the main CLI's 16 × 4096 is a GPU-sized step
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="PATH",
                   help=".txt files (or a folder of them), one .bin of token ids, or a folder saved by "
                        "datasets.save_to_disk; default: the embedded corpus")
    g.add_argument("--bin-dtype", default="uint16", help="token id type of a .bin: uint16 (default) or uint32")
    g.add_argument("--text-column", default="text", help="the text column of a Hugging Face dataset")
    g.add_argument("--eval-frac", type=float, default=0.1, help="held-out tail of the token stream (0.1)")
    g.add_argument("--cache-dir", help="tokenizer cache (default $ANATOMY_CACHE or ~/.cache/anatomy)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    t.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    t.add_argument("--optimizer", default=d.optimizer,
                   help=f"{' | '.join(OPTIMIZERS)}: torch's AdamW (fused on CUDA), or AdEMAMix (llm_anatomy.optim: a "
                        f"per-parameter loop for the baseline, a compiled foreach step for the efficient variant); "
                        f"default {d.optimizer}")
    t.add_argument("--schedule", default=d.schedule, help=f"{' | '.join(SCHEDULES)} (cosine decays to 0.1 × lr)")
    t.add_argument("--warmup", type=int, default=d.warmup, help="linear lr warm-up steps")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay, help="decoupled weight decay")
    t.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm; 0: no clipping")
    t.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evals; 0: only at the end")
    t.add_argument("--eval-batches", type=int, default=d.eval_batches, help="batches per eval")
    t.add_argument("--seed", type=int, default=d.seed, help="initial weights and data order")
    c = p.add_argument_group("checkpoints (safetensors + a sha256 manifest, written atomically, verified on resume)")
    c.add_argument("--ckpt-dir", help="where checkpoints go (none written without it)")
    c.add_argument("--ckpt-every", type=int, help="steps between checkpoints (default: --eval-every)")
    c.add_argument("--keep", type=int, default=d.keep,
                   help="newest checkpoints of this run kept (others' are never touched); 0 keeps all")
    c.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help="continue from PATH (a run directory or its step-N folder), or (no PATH) from the latest "
                        "checkpoint in --ckpt-dir if any; a damaged one is reported and an older one used")
    c.add_argument("--allow-changed", metavar="KEYS", type=lambda s: tuple(filter(None, s.split(","))),
                   help="resume although these parts of the run's identity changed (comma-separated: lr, schedule, "
                        "warmup, weight_decay, grad_clip, seed, run.batch, optimizer_hparams, ...); without it a "
                        "checkpoint written with other values is refused, listing them")
    r = p.add_argument_group("where and how")
    r.add_argument("--device", help="cpu | cuda (default: cuda when present)")
    r.add_argument("--strategy", default=d.strategy,
                   help=f"{' | '.join(STRATEGIES)}: auto = one process, or under torchrun ddp (baseline) / "
                        f"fsdp (efficient)")
    m = p.add_argument_group("tensor and pipeline parallel (under torchrun; FSDP2 over the remaining ranks)")
    m.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree: tp x dp = the world (either variant; "
                   "the efficient one without its lean block)")
    m.add_argument("--pp", type=int, default=d.pp, help="pipeline ranks: pp x dp = the world (untied models)")
    m.add_argument("--pp-schedule", default=d.pp_schedule,
                   help="1f1b | interleaved-1f1b (two stages per rank) — torch.distributed.pipelining's schedules")
    m.add_argument("--microbatches", type=int, help="micro-batches per pipeline step (default: --pp); divides --batch")
    r.add_argument("--deterministic", action="store_true", help="deterministic kernels (CUDA: exact resume)")
    r.add_argument("--out", help="train_log.json and loss.png go here (default: --ckpt-dir, else runs/train)")
    r.add_argument("--log-every", type=int, default=d.log_every, help="steps between log lines (no terminal)")
    r.add_argument("--progress", default=d.progress, help=" | ".join(PROGRESS))
    return p


def _options(a):
    from llm_anatomy.train.loop import TrainOptions

    return TrainOptions(steps=a.steps, lr=a.lr, optimizer=a.optimizer, schedule=a.schedule, warmup=a.warmup,
                        weight_decay=a.weight_decay, grad_clip=a.grad_clip, eval_every=a.eval_every,
                        eval_batches=a.eval_batches, ckpt_dir=a.ckpt_dir, ckpt_every=a.ckpt_every, keep=a.keep,
                        resume=a.resume, allow_changed=a.allow_changed or (), seed=a.seed, device=a.device, strategy=a.strategy, out=a.out,
                        log_every=a.log_every, progress=a.progress, deterministic=a.deterministic, tp=a.tp, pp=a.pp,
                        pp_schedule=a.pp_schedule, microbatches=a.microbatches)


def _say(kind: str, msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for everyone
        print(f"{PROG}: {kind}: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a = parser().parse_args(argv)
    except _UsageError as e:
        _say("error", e)
        return EXIT_BAD_INPUT
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        from llm_anatomy.train.loop import Diverged
    except ModuleNotFoundError as e:
        if e.name not in _EXTRA:
            raise
        _say("error", f"anatomy train needs {e.name}: pip install 'efficient-llm-anatomy[train]'")
        return EXIT_BAD_INPUT
    try:
        from llm_anatomy.cli_args import config_from_args, run_from_args
        from llm_anatomy.models import VARIANTS
        from llm_anatomy.train.data import load_data
        from llm_anatomy.train.loop import train

        cfg = config_from_args(a)
        if a.variant not in VARIANTS:
            raise ConfigError(f"unknown variant {a.variant!r}; choose baseline or efficient")
        run = run_from_args(a)
        for note in a.config_notes:
            _say("note", note)
        opts = _options(a)
        opts.validate()
        from llm_anatomy.train.mesh import check as check_mesh
        from llm_anatomy.train.setup import launched_world

        check_mesh(cfg, run, a.variant, opts, launched_world())  # before the data is read or tokenized
        data = load_data(a.data, cfg.vocab, cache_dir=a.cache_dir, bin_dtype=a.bin_dtype,
                         text_column=a.text_column, eval_frac=a.eval_frac, seq=run.seq)
        summary = train(cfg, run, a.variant, data, opts)
    except ConfigError as e:
        _say("error", e)
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as e:
        if e.name not in _EXTRA:
            raise
        _say("error", f"anatomy train needs {e.name}: pip install 'efficient-llm-anatomy[train]'")
        return EXIT_BAD_INPUT
    except Diverged as e:
        _say("diverged", e)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        _say("interrupted", "stopped by the user; the last checkpoint (if any) is intact")
        return EXIT_INTERRUPTED
    if a.json and os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    from llm_anatomy.distributed.strategies import exit_rank
    from llm_anatomy.entry import guarded

    exit_rank(guarded("anatomy train", main))
