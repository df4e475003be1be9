"""`anatomy`: estimate (calculator only), measure (this device), compare (both, with relative errors).

Bad input gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import json
import math
import os
import sys

from anatomy.cli_args import DEFAULT_PRESET, Parser, add_config_flags, config_from_args, nonempty  # noqa: F401
from anatomy.config import ConfigError, ModelConfig, Run, oneline

_Parser = Parser
_add_config_flags = add_config_flags  # the name anatomy/train/cli.py imports
MAX_WORLD = 2**20  # data-parallel ranks: more GPUs than any cluster has

def _check_variant(v: str) -> str:
    if v not in ("baseline", "efficient"):
        raise ConfigError(f"unknown variant {v!r}; choose baseline or efficient")
    return v


def cmd_estimate(a, cfg: ModelConfig, run: Run) -> dict:
    from anatomy.calculator import estimate

    from anatomy.calculator.memory import phases

    device = a.device or "cuda"
    out = estimate(cfg, run, _check_variant(a.variant), device=device).to_dict()
    ph = phases(cfg, run, a.variant, optimizer="adamw", device=device)
    out["memory"]["phases"] = {k: ph[k] for k in ("init", "forward_end", "forward_peak", "backward_peak",
                                                  "backward_peak_at", "backward_peak_by_kind", "backward_end",
                                                  "optimizer_end", "reserved_low", "reserved_high")}
    out["memory"]["phases"]["optimizer"] = "adamw"
    if a.world_size != 1 or a.strategy:
        from anatomy.calculator.comm import estimate_distributed

        if not 1 <= a.world_size <= MAX_WORLD:
            raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD:,}, got {a.world_size:.3g}")
        strategy = a.strategy or ("fsdp" if a.variant == "efficient" else "ddp")
        out["distributed"] = estimate_distributed(cfg, run, a.world_size, strategy, gpu=a.gpu or "h200-sxm",
                                                  variant=a.variant, device=device)
    if a.gpu is not None:
        from anatomy.calculator.timing import estimate_time

        t = estimate_time(cfg, run, a.variant, gpu=a.gpu)
        out["time"] = {k: t[k] for k in ("forward_backward_s", "optimizer_s", "step_s", "steady", "host_bound", "mfu",
                                         "components", "sources")
                       if k in t} | {"gpu": a.gpu, "profile": t["gpu"], "profile_kind": t["profile_kind"]}
        gpu_s = {ph: v["gpu_s"] for ph, v in t["phases"].items()}  # the kernels' time, the GPU's idle time left out
        out["time"]["gpu_busy_s"] = dict(forward_backward=gpu_s["forward"] + gpu_s["backward"],
                                         step=sum(gpu_s.values()))
        from anatomy.calculator.gpus import capacity_bytes

        cap, source = capacity_bytes(a.gpu)  # what mem_get_info reports free on an idle device
        need = max(ph["forward_peak"] or 0, ph["backward_peak"])
        if (pk := out.get("distributed", {}).get("peak")) is not None:
            need = pk["peak"]  # one rank's peak, with its sharding and communication buffers
        out["memory"]["fits"] = dict(gpu=a.gpu, need_bytes=need, capacity_bytes=cap, capacity_source=source,
                                     fits=need <= cap)
    return out


GiB = 2**30


def _usable_bytes(device: str) -> float:
    """Memory a measurement may take: 80% of what CUDA reports free, or a quarter of this machine's RAM."""
    if device == "cuda":
        import torch

        return 0.8 * torch.cuda.mem_get_info()[0]
    return 0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _need_bytes(cfg, run, variant, device) -> int:
    """A measurement's size by prediction: the saved tensors and 16 B a parameter (weights in fp32,
    gradients, and room for the transients)."""
    from anatomy.calculator import estimate

    est = estimate(cfg, run, variant, device=device)
    return est.to_dict()["memory"]["saved"]["total"] + 16 * est.params


def _measurable_run(cfg, run, variant, device) -> Run:
    """The run itself, or a smaller one (batch 1, then halved sequences) whose predicted size fits this
    device; a model that fits at no size is refused before anything is allocated."""
    cap = _usable_bytes(device)
    if 16 * cfg.rough_params > cap:  # the weights alone: no need to walk the layers
        raise ConfigError(f"measuring {cfg.name} needs at least {16 * cfg.rough_params / GiB:,.1f} GiB by prediction "
                          f"(16 B a parameter); {cap / GiB:,.1f} GiB of this {device} device is usable")
    r = run
    while (need := _need_bytes(cfg, r, variant, device)) > cap:
        if r.batch > 1:
            r = Run(batch=1, seq=r.seq, dtype=r.dtype, recompute=r.recompute)
        elif r.seq > 16:
            r = Run(batch=1, seq=r.seq // 2, dtype=r.dtype, recompute=r.recompute)
        else:
            raise ConfigError(f"measuring {cfg.name} needs {need / GiB:,.1f} GiB by prediction even at batch 1, seq "
                              f"{r.seq}; {cap / GiB:,.1f} GiB of this {device} device is usable")
    return r


def _recompute(out: dict) -> str:
    r = out["run"].get("recompute", "none")
    return "" if r == "none" else f" · recompute {r}"


def _device(a) -> str:
    import torch

    if a.device:
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but this machine has no CUDA GPU")
        return a.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_measure(a, cfg: ModelConfig, run: Run) -> dict:
    from anatomy.measure.run import measure

    dev = _device(a)
    sr = _measurable_run(cfg, run, _check_variant(a.variant), dev)
    return {"config": cfg.to_dict(), "run": run.to_dict(), **measure(cfg, run, a.variant, dev, saved_run=sr)}


def _rel(p, m):  # the same convention as the claims report: (predicted - measured) / measured
    return (p - m) / m if m else float(m != p)


def cmd_compare(a, cfg: ModelConfig, run: Run) -> dict:
    from anatomy.calculator import estimate

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
        t = Table(title=f"{out['config']['name']} · {out['variant']} · measured on {out['device']}")
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
    t = Table(title=f"{out['config']['name']} · {out['variant']} · B={out['run']['batch']} S={out['run']['seq']} "
                    f"{out['run']['dtype']}{_recompute(out)}")
    for c in ("component", "params", "fwd GFLOP (counter)", "bwd GFLOP (counter)", "fwd GFLOP (model)", "saved MiB"):
        t.add_column(c, justify="left" if c == "component" else "right")
    for name, c in out["components"].items():
        t.add_row(name, f"{c['params']:,}", f"{c['flops']['counter']['forward'] / 1e9:,.2f}",
                  f"{c['flops']['counter']['backward'] / 1e9:,.2f}", f"{c['flops']['model']['forward'] / 1e9:,.2f}",
                  f"{c['saved_bytes'] / 2**20:,.2f}")
    f, s = out["flops"], out["memory"]["saved"]
    t.add_row("total", f"{out['params']:,}", f"{f['counter']['forward'] / 1e9:,.2f}",
              f"{f['counter']['backward'] / 1e9:,.2f}", f"{f['model']['forward'] / 1e9:,.2f}",
              f"{s['total'] / 2**20:,.2f}", style="bold")
    con.print(t)
    if "phases" in out["memory"]:
        ph = out["memory"]["phases"]
        gib = lambda b: f"{b / 2**30:,.2f} GiB" if b is not None else "not modelled"  # noqa: E731
        con.print(f"memory with AdamW ({'CUDA, 512 B blocks' if out['device'] == 'cuda' else out['device']}): "
                  f"init {gib(ph['init'])} · forward end {gib(ph['forward_end'])} · forward peak "
                  f"{gib(ph['forward_peak'])} · backward peak {gib(ph['backward_peak'])} (at {ph['backward_peak_at']})"
                  f" · after backward {gib(ph['backward_end'])} · after the step {gib(ph['optimizer_end'])}")
        con.print("at the backward peak: " + " · ".join(
            f"{k} {v / 2**30:,.2f} GiB ({v / ph['backward_peak']:.0%})" for k, v in ph["backward_peak_by_kind"].items()
            if v))
        if out["device"] == "cuda":
            con.print(f"reserved by the caching allocator (looser): {gib(ph['reserved_low'])} to "
                      f"{gib(ph['reserved_high'])}")
    if "fits" in out["memory"]:
        f = out["memory"]["fits"]
        verdict = "fits" if f["fits"] else "predicted OOM"
        con.print(f"{verdict} on {f['gpu']}: needs {gib(f['need_bytes'])} of {gib(f['capacity_bytes'])}",
                  style=None if f["fits"] else "bold red")
    if "time" in out:
        tm = out["time"]
        con.print(f"predicted training step on {tm['gpu']}: {tm['steady']['step_s'] * 1e3:,.1f} ms, steps back to back "
                  f"(forward+backward {tm['steady']['forward_backward_s'] * 1e3:,.1f} ms); one step on an idle GPU "
                  f"{tm['step_s'] * 1e3:,.1f} ms (forward+backward {tm['forward_backward_s'] * 1e3:,.1f} ms, optimizer "
                  f"{tm['optimizer_s'] * 1e3:,.2f} ms)")
        busy = tm["gpu_busy_s"]["step"]
        con.print(f"the GPU's kernel time in that step: {busy * 1e3:,.1f} ms ({busy / tm['steady']['step_s']:.0%}; the "
                  "rest is the GPU waiting on the host)")
        if tm["host_bound"]:
            con.print("host-bound: the CPU issuing the kernels, not the GPU, sets this step's pace; on the H200 "
                      "machines measured, a host-bound step's time moved by 10-20% between processes and within "
                      "one (docs/timing.md), while its kernel time held to ±10%")
        from anatomy.calculator.timing import lookup as gpus

        measured = f"{gpus.profile_stem(tm['profile'])}-measured"
        if tm["profile_kind"] == "datasheet" and measured in gpus.names():
            con.print(f"(from datasheet figures; --gpu {measured} uses the profile `anatomy calibrate` measured on "
                      "one, which the H200 claims are checked against: docs/timing.md)")
    if "distributed" in out:
        d = out["distributed"]
        from anatomy.calculator.comm import render_distributed

        con.print(render_distributed(d), highlight=False)  # the full list of collectives: --json


COMMANDS = {"estimate": cmd_estimate, "measure": cmd_measure, "compare": cmd_compare}


def cmd_report(argv) -> int:
    """anatomy report [--readme README.md] CLAIMS.json...: regenerate the README's claim tables."""
    from pathlib import Path

    from anatomy import report

    p = _Parser(prog="anatomy report", description=cmd_report.__doc__)
    p.add_argument("claims", nargs="*", help="claims JSON files written by the validation suite; with none, "
                                             "every generated README section is rebuilt from reports/")
    p.add_argument("--readme", default="README.md")
    p.add_argument("--marker", default="claims-h200")
    a = p.parse_args(argv)
    if not a.claims:
        from anatomy.report.readme import regenerate

        try:
            print("regenerated:", ", ".join(regenerate(Path(a.readme))))
        except (OSError, ValueError, KeyError) as e:
            print(f"anatomy report: error: {oneline(str(e))}", file=sys.stderr)
            return 2
        return 0
    try:
        reports = report.load(a.claims)
        readme = Path(a.readme)
        report.write_atomic(readme, report.replace_between(readme.read_text(), a.marker, report.claims_table(reports)))
    except (OSError, ValueError, KeyError) as e:
        print(f"anatomy report: error: {oneline(str(e))}", file=sys.stderr)
        return 2
    print(f"updated {a.readme} ({a.marker}) from {len(reports)} report(s)")
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

    from anatomy import __version__

    try:
        return dist_version("efficient-llm-anatomy")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return __version__


# each command: the help line `anatomy -h` lists, and the description `anatomy CMD -h` opens with
HELP = {
    "plan": ("find the fastest run of a model that fits a GPU or N GPUs: micro-batch, recompute and strategy "
             "(see: anatomy plan -h)"),
    "estimate": ("predict parameters, FLOPs, saved tensors and memory from the architecture alone (no model "
                 "is built); with --gpu, the step time too"),
    "measure": "build the model on this machine and measure its parameters, FLOPs and saved tensors",
    "compare": "estimate and measure side by side, with the relative error of each figure",
    "report": "regenerate the README's generated tables from the claims JSON (see: anatomy report -h)",
    "train": "train a model on this machine, or on several GPUs under torchrun (see: anatomy train -h)",
    "sweep": "estimate (and optionally measure) over a grid of configs (see: anatomy sweep -h)",
    "forensics": "run a step and show memory by phase and what is live at the peak (see: anatomy forensics -h)",
    "calibrate": "measure this GPU's profile for the step-time model (see: anatomy calibrate -h)",
}


DELEGATED = ("plan", "report", "train", "sweep", "forensics", "calibrate")


def _delegate(cmd: str, argv: list[str]) -> int:
    """The commands whose flags live beside their code."""
    if cmd == "report":
        return cmd_report(argv)
    if cmd == "plan":
        from anatomy.plan_cli import main as run
    elif cmd == "train":
        from anatomy.train.cli import main as run
    elif cmd == "sweep":
        from anatomy.sweep import main as run
    elif cmd == "forensics":
        from anatomy.measure.forensics_cli import main as run
    else:
        from anatomy.measure.calibrate import main as run
    return run(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    p = Parser(prog="anatomy", description="Where every byte and FLOP of a transformer training step goes: "
                                           "predict it, measure it, compare the two.")
    p.add_argument("--version", action="version", version=f"anatomy {version()}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser, metavar="COMMAND")
    for name in COMMANDS:
        sp = sub.add_parser(name, help=HELP[name], description=HELP[name])
        add_config_flags(sp)
        sp.add_argument("--device", choices=("cpu", "cuda"),
                        help="the device predicted for or measured on (default: cuda if present, else cpu)"
                        if name != "estimate" else "the device predicted for (default: cuda)")
        if name == "estimate":
            sp.add_argument("--world-size", type=int, default=1, metavar="N",
                            help="data-parallel ranks (per-rank memory, communication)")
            sp.add_argument("--strategy", choices=("ddp", "fsdp"),
                            help="data-parallel strategy (default: ddp for the baseline, fsdp for the efficient "
                                 "variant)")
            sp.add_argument("--gpu", type=nonempty, metavar="NAME|PATH",
                            help="predict the step time on this GPU: a name (H200, H100, A100-80GB, RTX4090, "
                                 "h200-measured, ...) or a profile JSON written by `anatomy calibrate`")
    for name in DELEGATED:
        sub.add_parser(name, help=HELP[name], add_help=False)
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
        run = Run(batch=a.batch, seq=a.seq, dtype=a.dtype, recompute=a.recompute)
        if run.recompute != "none" and a.variant != "efficient":
            raise ConfigError(f"--recompute {run.recompute} is an option of the efficient variant (--variant efficient)")
        out = COMMANDS[a.cmd](a, cfg, run)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
