"""`anatomy`: estimate (calculator only), measure (this device), compare (both, with relative errors).

Bad input gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from dataclasses import replace

from llm_anatomy.cli_args import (DEFAULT_PRESET, Parser, add_config_flags, add_optimizer_flag,  # noqa: F401
                                  assumed, config_from_args, nonempty, run_from_args, say_assumed)
from llm_anatomy.cli_estimate import MAX_WORLD, _recompute, check_variant, estimate_all, print_estimate  # noqa: F401 (MAX_WORLD: re-exported)
from llm_anatomy.config import ConfigError, ModelConfig, Run, oneline

_Parser = Parser
_add_config_flags = add_config_flags  # the name llm_anatomy/train/cli.py imports
_check_variant = check_variant


def cmd_estimate(a, cfg: ModelConfig, run: Run) -> dict:
    return estimate_all(cfg, run, a.variant, device=a.device or "cuda", optimizer=a.optimizer, gpu=a.gpu,
                        world_size=a.world_size, strategy=a.strategy, gpus_per_node=a.gpus_per_node)


GiB = 2**30


USABLE = 0.8  # of the memory available, what a measurement may take: the rest is the interpreter's and torch's own
RAM_SHARE = 0.25  # and on CPU at most this share of the machine's RAM: a measurement's copies outgrow its prediction


def usable_bytes(device: str, ram_share: float = RAM_SHARE) -> tuple[int, str]:
    """(bytes a measurement may use on `device`, the figure said in a refusal): USABLE of what CUDA reports
    free; on CPU, USABLE of the RAM available now (MemAvailable) and at most ram_share of the machine's."""
    import os

    from llm_anatomy.sweep import available_bytes

    avail = available_bytes(device)
    cap = int(USABLE * avail)
    if device == "cuda":
        return cap, f"{avail / GiB:,.1f} GiB ({avail:,} B) free on this GPU, {USABLE:.0%} of it usable"
    cap = min(cap, int(ram_share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))
    return cap, (f"{avail / GiB:,.1f} GiB ({avail:,} B) of RAM available on this machine, {cap / GiB:,.1f} GiB of it "
                 "usable")


def refuse_unless_fits(what: str, need: int, device: str, how: str = "", ram_share: float = RAM_SHARE) -> None:
    """One line (ConfigError) when `need` bytes by prediction are more than `device` can give."""
    cap, avail = usable_bytes(device, ram_share)
    if need > cap:
        raise ConfigError(f"{what} needs {need / GiB:,.1f} GiB ({need:,} B) by prediction{how}; {avail}")


def _need_bytes(cfg, run, variant, device) -> int:
    """A measurement's size by prediction: the saved tensors and 16 B a parameter (weights in fp32,
    gradients, and room for the transients)."""
    from llm_anatomy.calculator import estimate

    est = estimate(cfg, run, variant, device=device)
    return est.to_dict()["memory"]["saved"]["total"] + 16 * est.params


def _measurable_run(cfg, run, variant, device) -> Run:
    """The run itself, or the same sequence at batch 1 when only that fits this device (a sequence's figures
    are the batch's, divided). A run that does not fit at batch 1 either is refused, in one line with the
    predicted bytes, the memory available and the longest --seq that fits, before anything is allocated: a
    shorter sequence than asked would measure another run (attention grows with its square), and at the
    length that fits, measuring on CPU can take minutes."""
    what = f"measuring {cfg.name} ({variant}{' with the lean block' if run.lean_block and variant == 'efficient' else ''})"
    refuse_unless_fits(what, 16 * cfg.rough_params, device, " for its weights alone (16 B a parameter)")
    cap, _ = usable_bytes(device)
    if _need_bytes(cfg, run, variant, device) <= cap:
        return run
    one = replace(run, batch=1)
    need = _need_bytes(cfg, one, variant, device)
    if need > cap:
        seq = one.seq // 2
        while seq > 1 and _need_bytes(cfg, replace(one, seq=seq), variant, device) > cap:
            seq //= 2
        fits = seq >= 1 and _need_bytes(cfg, replace(one, seq=seq), variant, device) <= cap
        refuse_unless_fits(what, need, device, f" at batch 1 and seq {one.seq:,}"
                                               f"{f' (--seq {seq:,} fits at batch 1)' if fits else ''}")
    return one


def _device(a) -> str:
    if a.device == "cpu":  # no torch import: a refusal on CPU answers at once
        return "cpu"
    import torch

    if a.device:
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but this machine has no CUDA GPU")
        return a.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_measure(a, cfg: ModelConfig, run: Run) -> dict:
    dev = _device(a)
    sr = _measurable_run(cfg, run, _check_variant(a.variant), dev)  # refused here, before the models are imported
    from llm_anatomy.measure.run import measure

    return {"config": cfg.to_dict(), "run": run.to_dict(), **measure(cfg, run, a.variant, dev, saved_run=sr)}


def _rel(p, m):  # the same convention as the claims report: (predicted - measured) / measured
    return (p - m) / m if m else float(m != p)


def cmd_compare(a, cfg: ModelConfig, run: Run) -> dict:
    from llm_anatomy.calculator import estimate

    meas = cmd_measure(a, cfg, run)
    est = estimate(cfg, run, a.variant, device=meas["device"]).to_dict()
    sr = Run(**meas["memory"]["saved"]["run"])
    est_saved = estimate(cfg, sr, a.variant, device=meas["device"]).to_dict()["memory"]["saved"]
    rows = [("params", est["params"], meas["params"], "")]
    est_flops = estimate(cfg, Run(**meas["flops"]["run"]), a.variant, device=meas["device"]).to_dict()["flops"]
    for d in ("forward", "backward"):
        rows.append((f"flops.counter.{d}", est_flops["counter"][d], meas["flops"]["counter"][d], "FLOP"))
    rows.append(("memory.saved.total", est_saved["total"], meas["memory"]["saved"]["total"], "B"))
    for comp, b in est_saved["by_component"].items():
        rows.append((f"memory.saved.by_component.{comp}", b, meas["memory"]["saved"]["by_component"].get(comp, 0), "B"))
    return {"config": cfg.to_dict(), "run": est["run"], "saved_run": meas["memory"]["saved"]["run"],
            "device": meas["device"], "variant": a.variant,
            "rows": [dict(key=k, predicted=p, measured=m, error=_rel(p, m), unit=u) for k, p, m, u in rows]}


def _fmt(n, unit="") -> str:
    if unit == "B":
        return f"{n / 2**20:,.2f} MiB"
    if unit == "FLOP":
        return f"{n / 1e9:,.3f} GFLOP"
    return f"{n:,}"


def _print(cmd: str, out: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(highlight=False)
    out = dict(out, config=dict(out["config"], name=escape(out["config"]["name"])))  # names and paths: no markup
    if "time" in out:
        out["time"] = dict(out["time"], gpu=escape(oneline(out["time"]["gpu"])))
    if "fits" in out.get("memory", {}):
        out["memory"] = dict(out["memory"], fits=dict(out["memory"]["fits"], gpu=escape(oneline(out["memory"]["fits"]["gpu"]))))
    if cmd == "compare":
        sr = out["saved_run"]
        t = Table(title=f"{out['config']['name']} · {out['variant']} · B={out['run']['batch']} S={out['run']['seq']} "
                        f"{out['run']['dtype']}{_recompute(out)} · measured on {out['device']}")
        for c in ("quantity", "predicted", "measured", "error"):
            t.add_column(c, justify="left" if c == "quantity" else "right")
        for r in out["rows"]:
            t.add_row(r["key"].replace("memory.saved.by_component.", "saved · "), _fmt(r["predicted"], r["unit"]), _fmt(r["measured"], r["unit"]), f"{r['error']:+.3%}")
        con.print(t)
        if (sr["batch"], sr["seq"]) != (out["run"]["batch"], out["run"]["seq"]):
            how = ("FLOPs at full size, counted on meta" if out["variant"] == "baseline" else
                   "the efficient variant's FLOPs at that size too: its SDPA kernel differs by device")
            con.print(f"saved tensors compared at B={sr['batch']} S={sr['seq']}: the full run's activations do not "
                      f"fit this {out['device']} device ({how}).")
        return
    if cmd == "measure":
        t = Table(title=f"{out['config']['name']} · {out['variant']}{_recompute(out)} · measured on {out['device']}")
        for c in ("quantity", "measured", "at"):
            t.add_column(c, justify="left" if c != "measured" else "right")
        fr, sr = out["flops"]["run"], out["memory"]["saved"]["run"]
        at = lambda r: f"B={r['batch']} S={r['seq']} {r['dtype']}"  # noqa: E731
        t.add_row("params", _fmt(out["params"]), "")
        for d in ("forward", "backward"):
            t.add_row(f"flops.counter.{d}", _fmt(out["flops"]["counter"][d], "FLOP"), at(fr))
        t.add_row("memory.saved.total", _fmt(out["memory"]["saved"]["total"], "B"), at(sr))
        for comp, b in out["memory"]["saved"]["by_component"].items():
            t.add_row(f"saved · {comp}", _fmt(b, "B"), at(sr))
        con.print(t)
        return
    print_estimate(con, out)


COMMANDS = {"estimate": cmd_estimate, "measure": cmd_measure, "compare": cmd_compare}


def cmd_report(argv) -> int:
    """anatomy report [--root DIR] [CLAIMS.json... [--doc FILE] [--marker NAME]]: regenerate the generated
    sections of a checkout (docs/results.md, the README's summary, docs/img/, docs/claims.md) from its reports/."""
    from llm_anatomy import records, report

    p = _Parser(prog="anatomy report", description=cmd_report.__doc__)
    p.add_argument("claims", nargs="*", help="claims JSON files written by the validation suite; with none, "
                                             "every generated section is rebuilt from the checkout's reports/")
    p.add_argument("--root", default=".", help="the checkout to read and write (default: the current directory)")
    p.add_argument("--doc", "--readme", dest="doc", default="docs/results.md",
                   help="with CLAIMS.json: the document whose marker section is rewritten, relative to --root")
    p.add_argument("--marker", default="claims-h200")
    a = p.parse_args(argv)
    try:
        root = records.checkout(a.root)
    except records.NotACheckout as e:
        print(f"anatomy report: error: {oneline(str(e))}", file=sys.stderr)
        return 2
    if not a.claims:
        from llm_anatomy.report.regenerate import regenerate

        try:
            print("regenerated:", ", ".join(regenerate(root)))
        except (OSError, ValueError, KeyError) as e:
            print(f"anatomy report: error: {oneline(str(e))}", file=sys.stderr)
            return 2
        return 0
    try:
        reports = report.load(a.claims)
        doc = Path(a.root) / a.doc  # the checkout as the user named it: errors name the path as typed
        report.write_atomic(doc, report.replace_between(report.read_readme(doc), a.marker, report.claims_table(reports)))
    except (OSError, ValueError, KeyError) as e:
        print(f"anatomy report: error: {oneline(str(e))}", file=sys.stderr)
        return 2
    print(f"updated {a.doc} ({a.marker}) from {len(reports)} report(s)")
    return 0


def _nonfinite(x, path: str = "") -> str | None:
    """The dotted key of the first NaN or infinity in a result, or None."""
    if isinstance(x, float) and not math.isfinite(x):
        return path or "the top"
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
    for k, v in items:
        if (where := _nonfinite(v, f"{path}.{k}" if path else str(k))) is not None:
            return where
    return None


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    from llm_anatomy import __version__

    try:
        return dist_version("efficient-llm-anatomy")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return __version__


# each command: the help line `anatomy -h` lists, and the description `anatomy CMD -h` opens with
HELP = {
    "plan": ("find the fastest run of a model that fits a GPU or N GPUs: micro-batch, recompute and strategy "
             "(see: anatomy plan -h)"),
    "estimate": ("predict parameters, FLOPs, saved tensors and memory (with the optimizer's state) from the "
                 "architecture alone (no model is built); with --gpu, the step time and whether it fits"),
    "measure": "build the model on this machine and measure its parameters, FLOPs and saved tensors",
    "compare": "estimate and measure side by side, with the relative error of each figure",
    "report": "regenerate docs/results.md and the README's summary from reports/ (see: anatomy report -h)",
    "train": "train a model on this machine, or on several GPUs under torchrun (see: anatomy train -h)",
    "sweep": "estimate (and optionally measure) over a grid of configs (see: anatomy sweep -h)",
    "forensics": "run a step and show memory by phase and what is live at the peak (see: anatomy forensics -h)",
    "calibrate": "measure this GPU's profile for the step-time model (see: anatomy calibrate -h)",
}


# the commands whose flags live beside their code: name -> "module:function", called with the argv after
# the name. A new command is one line here and one in HELP.
DELEGATED = {
    "plan": "llm_anatomy.plan_cli:main",
    "report": "llm_anatomy.cli:cmd_report",
    "train": "llm_anatomy.train.cli:main",
    "sweep": "llm_anatomy.sweep:main",
    "forensics": "llm_anatomy.measure.forensics_cli:main",
    "calibrate": "llm_anatomy.measure.calibrate:main",
}


def _delegate(cmd: str, argv: list[str]) -> int:
    from importlib import import_module

    module, func = DELEGATED[cmd].split(":")
    return getattr(import_module(module), func)(argv)


def main(argv=None) -> int:
    """The `anatomy` command; its output failures and a closed pipe end as llm_anatomy/entry.py says."""
    from llm_anatomy.entry import guarded

    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded(f"anatomy {argv[0]}" if argv[:1] and argv[0] in HELP else "anatomy", _main, argv)


def _main(argv: list[str]) -> int:
    if argv[:1] and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    p = Parser(prog="anatomy", description="Where every byte and FLOP of a transformer training step goes: "
                                           "predict it, measure it, compare the two.")
    p.add_argument("--version", action="version", version=f"anatomy {version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser, metavar="COMMAND")
    for name in HELP:  # in HELP's order
        if name in DELEGATED:
            sub.add_parser(name, help=HELP[name], add_help=False)
            continue
        sp = sub.add_parser(name, help=HELP[name], description=HELP[name])
        add_config_flags(sp)
        sp.add_argument("--device", choices=("cpu", "cuda"),
                        help="the device predicted for or measured on (default: cuda if present, else cpu)"
                        if name != "estimate" else "the device predicted for (default: cuda)")
        if name == "estimate":
            add_optimizer_flag(sp)
            sp.add_argument("--world-size", type=int, default=1, metavar="N",
                            help="data-parallel ranks (per-rank memory, communication)")
            sp.add_argument("--strategy", choices=("ddp", "fsdp"),
                            help="data-parallel strategy (default: ddp for the baseline, fsdp for the efficient "
                                 "variant)")
            sp.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                            help="GPUs per node: beyond one node, collectives cross the inter-node network")
            sp.add_argument("--gpu", type=nonempty, metavar="NAME|PATH",
                            help="predict the step time on this GPU: a name (H200, H100, A100-80GB, RTX4090, "
                                 "h200-measured, H100-datasheet, ...; docs/derived-gpus.md) or a profile JSON "
                                 "written by `anatomy calibrate`")
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
        run = run_from_args(a)
        out = COMMANDS[a.cmd](a, cfg, run)
        out["lean"] = a.variant == "efficient" and run.lean_block  # the block that ran, said even when plain
        out["defaults"] = assumed(a, run, a.variant)
        if (where := _nonfinite(out)) is not None:  # a profile or a config value outside what the model covers
            raise ConfigError(f"the {a.cmd} came out non-finite at {where}: an input is out of the model's range")
        text = json.dumps(out, indent=1) if a.json else None
    except ConfigError as e:
        print(f"anatomy {a.cmd}: error: {oneline(e)}", file=sys.stderr)
        return 2
    for note in a.config_notes:
        print(f"anatomy {a.cmd}: note: {oneline(note)}", file=sys.stderr)
    if a.json:
        print(text)
    else:
        _print(a.cmd, out)
        if line := say_assumed(out["defaults"]):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
