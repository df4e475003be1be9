"""`anatomy sweep`: the calculator over a grid of configs, and optionally a measurement of each.

    anatomy sweep [--preset seed llama2-7b | --hf-config PATH... | fields] [--hidden 512,1024] [--layers 2,4]
                  [--batch 1,16] [--seq 1024,4096] [--dtype amp] [--variant baseline,efficient]
                  [--optimizer adamw|ademamix] [--gpu NAME] [--world-size N --strategy ddp|fsdp]
                  [--measure [on|off]] [--device auto|cpu|cuda] [--mem-limit GIB] [--out .anatomy/sweep.json] [--quiet]

The models: presets, Hugging Face config.json files, or explicit fields (--hidden --layers --heads
--intermediate --vocab, as `anatomy estimate` takes them). Fields given beside a preset or a config
override it, as in estimate. Lists take commas or spaces. With a preset or a config, --hidden/--layers
reshape each model: layers is replaced; hidden is replaced keeping its head_dim (heads = hidden /
head_dim), its GQA group size and its intermediate/hidden ratio (rounded), so "seed at hidden 1024" is
the seed's shape, twice as wide.

Each (config, batch, seq, dtype, variant) point yields claim rows in the validation suite's shape
(test, claim, component, config, variant, predicted, measured, error, tolerance, unit, device,
passed, note; plus batch, seq, dtype and status): params, counter FLOPs forward/backward (model and
per component), saved bytes (total and per component), and the step's peak with the optimizer's
state (need_bytes: `anatomy estimate`'s memory.need_bytes, the same function); with --gpu, the step
time and whether the peak fits; with --world-size, the per-rank memory of the strategy.
Without --measure, measured/error/passed are null and status is "predicted". With --measure, a
point whose predicted need is over this device's available memory is not run: status "skipped", the
reason quotes the predicted bytes. An out-of-memory error the calculator did not predict is caught:
status "failed", the error in the note. The report (date, machine, command, grid, rows) is written
atomically to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from llm_anatomy.cli_args import HF_CONFIG_HELP, Parser, add_model_fields, add_optimizer_flag, nonempty
from llm_anatomy.config import PRESETS, ConfigError, ModelConfig, Run, oneline
from llm_anatomy.cli_estimate import peak_bytes
from llm_anatomy.io import OutputError, refuse_special_target, write_atomic
from llm_anatomy.sweep_grid import VARIANTS, _flat, _list, grid, models, reshape  # noqa: F401 (re-exported)
NEED = "memory.need (peak, with the optimizer's state)"  # anatomy estimate's memory.need_bytes
COMPONENTS = ("embedding", "attention", "norm", "mlp", "loss")
GiB = 2**30
MAX_POINTS = 10_000  # grid points in one sweep: an estimate each takes milliseconds to a second
MAX_MEM_LIMIT_GIB = 2**20  # a pebibyte: more memory than any one machine has
MAX_WORLD = 2**20  # data-parallel ranks: more GPUs than any cluster has (llm_anatomy.cli_estimate's bound)


# ---- memory: does a point fit? -------------------------------------------------------------------
def need_bytes(cfg: ModelConfig, run: Run, variant: str, device: str, optimizer: str = "adamw") -> int:
    """What a training step of the point needs at its peak, by the calculator, the optimizer's state
    included: anatomy estimate's memory.need_bytes."""
    from llm_anatomy.calculator.memory import phases

    return peak_bytes(phases(cfg, run, variant, optimizer=optimizer, device=device))


def available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# ---- rows ----------------------------------------------------------------------------------------
def _row(claim, component, cfg, run, variant, predicted, measured, unit, device, status, note="") -> dict:
    if measured is None:
        err = passed = None
    else:
        err = float((measured - predicted) / predicted) if predicted else float(measured != predicted)
        passed = measured == predicted
    return dict(test="anatomy sweep", claim=claim, component=component, config=cfg.name, variant=variant,
                predicted=predicted, measured=measured, error=err, tolerance=0.0, unit=unit, device=device,
                passed=passed, note=note, batch=run.batch, seq=run.seq, dtype=run.dtype, lean=run.lean, status=status)


def point_rows(cfg: ModelConfig, run: Run, variant: str, device: str, meas: dict | None, status: str,
               note: str = "", need: int | None = None, est: dict | None = None) -> list[dict]:
    """Claim rows for one point: every prediction, with its measurement where `meas` has one. est: the
    point's `anatomy estimate` output (llm_anatomy.cli_estimate.estimate_all), whose time, fit and per-rank memory
    become rows too where it has them."""
    if est is None:
        from llm_anatomy.calculator import estimate

        est = estimate(cfg, run, variant, device=device).to_dict()
    m = meas or {}
    mf = (m.get("flops") or {}).get("by_component", {})
    ms = (m.get("memory") or {}).get("saved", {})
    mget = (lambda f: f() if meas else None)
    rows = [_row("params", "model", cfg, run, variant, est["params"], mget(lambda: m["params"]), "", device, status, note)]
    for d in ("forward", "backward"):
        rows.append(_row(f"flops.counter.{d}", "model", cfg, run, variant, est["flops"]["counter"][d],
                         mget(lambda: m["flops"]["counter"][d]), "FLOP", device, status, note))
        for comp in COMPONENTS:
            rows.append(_row(f"flops.counter.{d}", comp, cfg, run, variant,
                             est["components"][comp]["flops"]["counter"][d],
                             mget(lambda: mf.get(d, {}).get(comp, 0)), "FLOP", device, status, note))
    rows.append(_row("memory.saved.total", "model", cfg, run, variant, est["memory"]["saved"]["total"],
                     mget(lambda: ms["total"]), "B", device, status, note))
    for comp in COMPONENTS:
        rows.append(_row("memory.saved", comp, cfg, run, variant, est["memory"]["saved"]["by_component"][comp],
                         mget(lambda: ms["by_component"].get(comp, 0)), "B", device, status, note))
    only = note or "predicted only"
    if need is not None:  # a prediction only: llm_anatomy.measure.run does not measure the peak
        rows.append(_row(NEED, "model", cfg, run, variant, need, None, "B", device, status, only))
    if "time" in est:
        t = est["time"]
        rows.append(_row(f"time.step (steps back to back, {t['gpu']})", "model", cfg, run, variant,
                         t["steady"]["step_s"], None, "s", device, status, only))
    if "fits" in est["memory"]:
        f = est["memory"]["fits"]
        rows.append(_row(f"memory.capacity ({f['gpu']})", "model", cfg, run, variant, f["capacity_bytes"], None, "B",
                         device, status, only))
    if "distributed" in est:
        d = est["distributed"]
        rows.append(_row(f"memory.per_rank ({d['strategy']} on {d['world_size']})", "model", cfg, run, variant,
                         d["memory"]["total"], None, "B", device, status, only))
    return rows


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # the CPU allocator's OOM


def sweep(points, *, measure: bool = False, device: str = "cpu", limit: int | None = None, progress=None,
          measure_fn=None, optimizer: str = "adamw", gpu: str | None = None, world_size: int = 1,
          strategy: str | None = None) -> list[dict]:
    """Rows for every point, each point predicted by `anatomy estimate`'s own function (estimate_all) with
    this optimizer, GPU and world. `limit`: the bytes a measurement may use (default:
    available_bytes(device)). `measure_fn` (tests): replaces llm_anatomy.measure.run.measure."""
    from llm_anatomy.cli_estimate import estimate_all

    rows = []
    for cfg, run, variant in points:
        if progress:
            progress(f"{cfg.name} B={run.batch} S={run.seq} {run.dtype} {variant}")
        est = estimate_all(cfg, run, variant, device=device, optimizer=optimizer, gpu=gpu, world_size=world_size,
                           strategy=strategy)
        need = est["memory"]["need_bytes"]
        if not measure:
            rows += point_rows(cfg, run, variant, device, None, "predicted", need=need, est=est)
            continue
        avail = limit if limit is not None else available_bytes(device)
        if need > avail:
            rows += point_rows(cfg, run, variant, device, None, "skipped", need=need, est=est,
                               note=f"predicted to need {need / GiB:,.2f} GiB ({need:,} B) at its peak, the "
                                    f"{optimizer} state included; {avail / GiB:,.2f} GiB available on {device}: "
                                    "not run")
            continue
        if measure_fn is None:
            from llm_anatomy.measure.run import measure as measure_fn
        try:
            meas = measure_fn(cfg, run, variant, device)
        except Exception as e:  # noqa: BLE001 - only an OOM is recorded; anything else is a bug and re-raised
            if not _is_oom(e):
                raise
            meas = None
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows += point_rows(cfg, run, variant, device, None, "failed", need=need, est=est,
                               note=f"out of memory although predicted to need {need / GiB:,.2f} GiB of "
                                    f"{avail / GiB:,.2f} GiB: {msg}")
        else:
            rows += point_rows(cfg, run, variant, device, meas, "measured", need=need, est=est)
        finally:
            gc.collect()
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    return rows


def machine() -> dict:
    info = dict(python=platform.python_version(), platform=platform.platform())
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_report(path: Path, report: dict) -> None:
    write_atomic(path, json.dumps(report, indent=1, allow_nan=False), parents=True)  # all or nothing


def _summary(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    by: dict[tuple, dict] = {}
    for x in rows:
        by.setdefault((x["config"], x["batch"], x["seq"], x["dtype"], x["variant"]), {})[x["claim"].split(" (")[0],
                                                                                        x["component"]] = x
    timed = any(("time.step", "model") in g for g in by.values())
    ranked = any(("memory.per_rank", "model") in g for g in by.values())
    t = Table(title="anatomy sweep (params in millions; GiB = 2^30 B)")
    cols = ["config", "B", "S", "variant", "params (M)", "fwd TFLOP", "saved GiB", "need GiB"]
    cols += ["per rank GiB"] * ranked + ["step ms", "fits"] * timed + ["status"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("config", "variant", "status") else "right", overflow="fold")
    for (config, batch, seq, _, variant), get in by.items():
        r = get[("memory.saved.total", "model")]
        saved = f"{r['predicted'] / 2**30:,.3f}"
        if r["measured"] is not None:
            saved += f" / {r['measured'] / 2**30:,.3f}"
        need = get[("memory.need", "model")]["predicted"]
        bad = [x for x in get.values() if x["passed"] is False]
        cells = [escape(config), str(batch), str(seq), variant, f"{get[('params', 'model')]['predicted'] / 1e6:,.2f}",
                 f"{get[('flops.counter.forward', 'model')]['predicted'] / 1e12:,.3f}", saved, f"{need / 2**30:,.2f}"]
        if ranked:
            cells.append(f"{get[('memory.per_rank', 'model')]['predicted'] / 2**30:,.2f}")
        if timed:
            cap = get[("memory.capacity", "model")]["predicted"]
            cells += [f"{get[('time.step', 'model')]['predicted'] * 1e3:,.1f}", "yes" if need <= cap else "no"]
        t.add_row(*cells, r["status"] + (f" ({len(bad)} mismatched)" if bad else ""))
    con = Console(highlight=False)
    if not con.is_terminal:  # a file or a pipe: as wide as the table, never a wrapped figure
        con.width = max(con.width, con.measure(t, options=con.options.update_width(1000)).maximum)
    con.print(t)


def _with_bar(points, **kw) -> list[dict]:
    """sweep() under a progress bar on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=len(points))
        started = [False]

        def tick(desc: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=desc)

        rows = sweep(points, progress=tick, **kw)
        bar.update(task, completed=len(points), description="done")
    return rows


def main(argv=None) -> int:
    """anatomy sweep: the calculator (and optionally a measurement) over a grid of configs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = Parser(prog="anatomy sweep", description=main.__doc__)
    g = p.add_argument_group("models (presets, Hugging Face configs, or explicit fields; fields override)")
    g.add_argument("--preset", nargs="+", type=_list(str), help=f"presets (default seed): {', '.join(PRESETS)}")
    g.add_argument("--hf-config", nargs="+", type=nonempty, metavar="PATH", help=HF_CONFIG_HELP + "; several allowed")
    g.add_argument("--hidden", nargs="+", type=_list(int),
                   help="widths (a preset or config keeps its head_dim, GQA group and MLP ratio)")
    g.add_argument("--layers", nargs="+", type=_list(int), help="depths")
    add_model_fields(g, widths=False)
    r = p.add_argument_group("runs")
    r.add_argument("--batch", nargs="+", type=_list(int), help="batch sizes (default 16)")
    r.add_argument("--seq", nargs="+", type=_list(int), help="sequence lengths (default 4096)")
    r.add_argument("--dtype", nargs="+", type=_list(str), help="amp | bf16 | fp32 (default amp)")
    r.add_argument("--variant", nargs="+", type=_list(str), help="baseline, efficient (default both)")
    r.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help="the efficient variant's points with its lean block (Run.lean); --no-lean: the plain block")
    add_optimizer_flag(r)
    r.add_argument("--gpu", type=nonempty, metavar="NAME|PATH",
                   help="also predict each step's time on this GPU and whether its peak fits (as anatomy estimate)")
    r.add_argument("--world-size", type=int, default=1, metavar="N", help="data-parallel ranks: per-rank memory")
    r.add_argument("--strategy", choices=("ddp", "fsdp"),
                   help="data-parallel strategy (default: ddp for the baseline, fsdp for the efficient variant)")
    p.add_argument("--measure", nargs="?", const="on", default="off", choices=("on", "off"),
                   help="also measure each point that fits this device (default off)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="the device predicted for and measured on (auto: cuda if present, else cpu)")
    p.add_argument("--mem-limit", type=float, metavar="GIB",
                   help="memory a measurement may use, GiB (default: what this device has available)")
    p.add_argument("--out", default=".anatomy/sweep.json", type=nonempty, help="the JSON report (written atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary table")
    a = p.parse_args(argv)
    measure = a.measure == "on"
    try:
        dev = a.device
        if dev == "auto" or (measure and dev == "cuda"):
            import torch

            has_cuda = torch.cuda.is_available()
            if dev == "cuda" and not has_cuda:
                raise ConfigError("--device cuda --measure asked for, but this machine has no CUDA GPU")
            dev = "cuda" if dev == "cuda" or has_cuda else "cpu"
        if a.mem_limit is not None and not 0 < a.mem_limit <= MAX_MEM_LIMIT_GIB:
            raise ConfigError(f"--mem-limit must be a number of GiB > 0 and at most {MAX_MEM_LIMIT_GIB:,}, "
                              f"got {a.mem_limit}")
        lists = [_flat(a.preset, ["seed"]), _flat(a.hidden, [None]), _flat(a.layers, [None]), _flat(a.batch, [16]),
                 _flat(a.seq, [4096]), _flat(a.dtype, ["amp"]), _flat(a.variant, VARIANTS)]
        if math.prod(len(x) for x in lists) > MAX_POINTS:
            raise ConfigError(f"the grid has {math.prod(len(x) for x in lists):,} points; at most {MAX_POINTS:,} "
                              "in one sweep")
        cfgs, hiddens, depths, notes = models(a, _flat(a.seq, [4096]))
        points = grid(cfgs, hiddens, depths, _flat(a.batch, [16]), _flat(a.seq, [4096]), _flat(a.dtype, ["amp"]),
                      _flat(a.variant, VARIANTS), lean=a.lean)
        if points and a.gpu is not None:  # an unknown GPU is refused before the sweep starts
            from llm_anatomy.calculator.timing import lookup as gpus

            gpus.get(a.gpu)
        if not 1 <= a.world_size <= MAX_WORLD:
            raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD:,}, got {a.world_size:.3g}")
        refuse_special_target(a.out, "--out target")  # a directory, a device, a FIFO: refused before the sweep
    except ConfigError as e:
        print(f"anatomy sweep: error: {oneline(e)}", file=sys.stderr)
        return 2
    limit = int(a.mem_limit * GiB) if a.mem_limit is not None else None
    t0 = time.time()
    world = dict(optimizer=a.optimizer, gpu=a.gpu, world_size=a.world_size, strategy=a.strategy)
    try:
        if a.quiet:
            rows = sweep(points, measure=measure, device=dev, limit=limit, **world)
        else:
            rows = _with_bar(points, measure=measure, device=dev, limit=limit, **world)
    except ConfigError as e:  # a point the calculator refuses (a profile, a range)
        print(f"anatomy sweep: error: {oneline(e)}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"anatomy sweep: note: {oneline(note)}", file=sys.stderr)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=machine(),
                  command="anatomy sweep " + " ".join(argv), seconds=round(time.time() - t0, 3),
                  grid=dict(points=len(points), device=dev, measure=measure, mem_limit_bytes=limit, **world),
                  rows=rows)
    try:
        write_report(Path(a.out), report)
    except (OutputError, ConfigError) as e:  # each names the path and why
        print(f"anatomy sweep: error: {oneline(e)}", file=sys.stderr)
        return 2
    if not a.quiet:
        _summary(rows)
        print(f"{len(rows)} rows for {len(points)} points -> {a.out}")
    # exit 1 when a measurement contradicts a prediction: a mismatched exact quantity or an unpredicted OOM
    return 1 if any(r["passed"] is False or r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    from llm_anatomy.entry import guarded

    sys.exit(guarded("anatomy sweep", main))
