"""`anatomy forensics`'s command line: run a step on CUDA (or CPU live storage), print the phase
table and the peak's contents, write the JSON report and the picture. The replay and attribution
it prints are llm_anatomy/measure/forensics.py's."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from llm_anatomy.io import refuse_special_target, write_atomic
from llm_anatomy.measure.forensics import attribute_peak, plot_timeline, replay


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:  # a file or a pipe: wide enough for every table, never a cut path or figure
        con.width = max(con.width, 160)
    t = Table(title=f"{report['title']}: memory at the phase boundaries of the last step (MiB = 2^20 B)")
    for c in ("phase", "allocated", "peak in phase", "reserved"):
        t.add_column(c, justify="left" if c == "phase" else "right")
    for p in report["phases"]:
        t.add_row(p["name"], _mib(p["allocated"]), _mib(p["peak"]), _mib(p["reserved"]) if "reserved" in p else "-")
    con.print(t)
    pk = report["peak"]
    con.print(f"peak {_mib(pk['peak_bytes'])} MiB in step {pk['peak_step']}, {pk['peak_phase']} "
              f"(while {pk['peak_during']} ran); {_mib(pk['pre_existing_bytes'])} MiB were allocated before recording")
    t = Table(title="live at the peak, by component")
    for c in ("component", "MiB", "share"):
        t.add_column(c, justify="left" if c == "component" else "right")
    for comp, b in pk["by_component"].items():
        t.add_row(comp, _mib(b), f"{b / max(pk['peak_bytes'], 1):.1%}")
    con.print(t)
    t = Table(title=f"the {len(pk['top'])} largest allocations live at the peak")
    for c in ("MiB", "component", "via", "kind", "made in", "where"):
        t.add_column(c, justify="right" if c == "MiB" else "left", overflow="fold")
    for a in pk["top"]:
        t.add_row(_mib(a["size"]), a["component"], a["via"], a["kind"], f"{a['phase']} (step {a['step']})", a["where"])
    con.print(t)
    con.print(f"plot: {report['png']}   report: {report['out']}")
    from llm_anatomy.cli_args import say_assumed

    if line := say_assumed(report["defaults"]):
        con.print(line, highlight=False)


def main(argv=None) -> int:
    """anatomy forensics: the phase table and the contents of the peak of a training step (CUDA, or CPU)."""
    from llm_anatomy.cli_args import OPTIMIZER_HELP, Parser, add_config_flags, config_from_args, run_from_args
    from llm_anatomy.config import ConfigError, oneline

    p = Parser(prog="anatomy forensics", description=main.__doc__)
    add_config_flags(p)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "ademamix", "none"),
                   help=OPTIMIZER_HELP + "; none: no optimizer step")
    p.add_argument("--top", type=int, default=12, help="how many of the largest live allocations to list")
    p.add_argument("--png", help="plot path (default .anatomy/forensics/<config>-<variant>-B<b>-S<s>.png)")
    p.add_argument("--out", help="JSON report path (default: the plot's path with .json)")
    p.add_argument("--peak-phase", choices=("forward", "backward", "optimizer"),
                   help="attribute the peak inside this phase instead of the step's overall peak")
    p.add_argument("--snapshot", help="also pickle the raw snapshot here (for pytorch.org/memory_viz)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if present, else cpu (live tensor "
                   "storage, llm_anatomy.measure.liveness: exact sizes, no allocator rounding)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(a)
        if a.variant not in ("baseline", "efficient"):
            raise ConfigError(f"unknown variant {a.variant!r}; choose baseline or efficient")
        run = run_from_args(a)
        if a.top < 1:
            raise ConfigError(f"--top must be >= 1, got {a.top}")
        if a.png is not None and Path(a.png).suffix.lower() != ".png":
            raise ConfigError(f"--png must name a .png file, got {oneline(repr(a.png), 60)}")
        if a.out is not None and Path(a.out).suffix.lower() != ".json":
            raise ConfigError(f"--out must name a .json file, got {oneline(repr(a.out), 60)}")
        for flag, target in (("--png", a.png), ("--out", a.out), ("--snapshot", a.snapshot)):
            if target is not None:  # a device or a FIFO is refused before the step runs, not after
                refuse_special_target(target, f"{flag} target")
    except ConfigError as e:
        print(f"anatomy forensics: error: {oneline(e)}", file=sys.stderr)
        return 2
    try:
        if a.device == "cpu":  # refused before torch is imported: a model too big for RAM answers at once
            _refuse_unless_fits(cfg, run, a.variant, None if a.optimizer == "none" else a.optimizer, "cpu")
        import torch

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda needs a CUDA GPU; this machine has none (use --device cpu)")
        if a.device != "cpu":
            _refuse_unless_fits(cfg, run, a.variant, None if a.optimizer == "none" else a.optimizer, device)
    except ConfigError as e:
        print(f"anatomy forensics: error: {oneline(e)}", file=sys.stderr)
        return 2
    for note in a.config_notes:
        print(f"anatomy forensics: note: {oneline(note)}", file=sys.stderr)
    return _record_and_report(a, cfg, run, device, sys.argv[1:] if argv is None else argv)


def _refuse_unless_fits(cfg, run, variant: str, optimizer: str | None, device: str) -> None:
    """The step's peak by prediction (the weights alone first: no need to walk the layers of a model whose
    weights cannot fit), against the memory this device has available: one line, before anything is built."""
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.cli import refuse_unless_fits
    from llm_anatomy.cli_estimate import peak_bytes

    what = f"a {variant} step of {cfg.name} at B={run.batch} S={run.seq}"
    # the step's own peak is predicted (memory.phases), so all the memory available may be asked for
    refuse_unless_fits(what, 4 * cfg.rough_params, device, " for its fp32 weights alone", ram_share=1.0)
    refuse_unless_fits(what, peak_bytes(phases(cfg, run, variant, optimizer=optimizer, device=device)), device,
                       f" at its peak{f', the {optimizer} state included' if optimizer else ''}", ram_share=1.0)


def _record_and_report(a: argparse.Namespace, cfg, run, device: str, argv: list[str]) -> int:
    """Measure the phases, record the step's allocations, replay them; write the plot and the JSON
    report, and print it (a table, or the JSON with --json)."""
    import torch

    from llm_anatomy.cli_args import assumed

    if device == "cuda":
        from llm_anatomy.measure.memory import measure_phases, record_step
    else:
        from llm_anatomy.measure.liveness import measure_phases_live as measure_phases
        from llm_anatomy.measure.liveness import record_step_live as record_step

    opt = None if a.optimizer == "none" else a.optimizer
    rec = "" if run.recompute == "none" else f"-recompute-{run.recompute}"
    lean = a.variant == "efficient" and run.lean_block
    stem = f"{cfg.name}-{a.variant}{'-lean' if lean else ''}{rec}-B{run.batch}-S{run.seq}"
    png = Path(a.png or f".anatomy/forensics/{stem}.png")
    out = Path(a.out or png.with_suffix(".json"))
    try:
        phases = measure_phases(cfg, run, a.variant, optimizer=opt)
        snap = record_step(cfg, run, a.variant, optimizer=opt)
    except torch.OutOfMemoryError as e:
        print(f"anatomy forensics: error: out of memory at {stem}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if a.snapshot:
        import pickle

        write_atomic(a.snapshot, pickle.dumps(snap), parents=True)
    r = replay(snap, peak_phase=a.peak_phase)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU live tensor storage"
    title = (f"{cfg.name} · {a.variant}{' (lean block)' if lean else ''}"
             f"{'' if not rec else f' (recompute {run.recompute})'} · B={run.batch} "
             f"S={run.seq} {run.dtype} · {where}")
    plot_timeline(r, png, title)
    report = dict(title=title, config=cfg.to_dict(), run=run.to_dict(),
                  variant=a.variant, lean=lean, defaults=assumed(a, run, a.variant), optimizer=opt, phases=phases,
                  peak=attribute_peak(snap, a.top, phase=a.peak_phase),
                  png=str(png), out=str(out), device=where, torch=torch.__version__,
                  cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  command="anatomy forensics " + " ".join(argv))
    write_atomic(out, json.dumps(report, indent=1), parents=True)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    from llm_anatomy.entry import guarded

    sys.exit(guarded("anatomy forensics", main))
