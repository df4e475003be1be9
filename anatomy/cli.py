"""`anatomy`: estimate (calculator only), measure (this device), compare (both, with relative errors).

Bad input gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from anatomy.config import ConfigError, ModelConfig, Run, PRESETS, from_hf_config

DEFAULT_PRESET = "seed"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        print(f"anatomy: error: {message}", file=sys.stderr)
        sys.exit(2)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, an HF config.json, or explicit fields; fields override)")
    g.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (default {DEFAULT_PRESET})")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face Llama-family config.json or its folder")
    for f in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab"):
        g.add_argument(f"--{f}", type=int)
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--mlp", choices=("swiglu", "gpt-oss"))
    r = p.add_argument_group("run")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--seq", type=int, default=4096)
    r.add_argument("--dtype", default="amp", help="amp (bf16 autocast, fp32 master weights) | bf16 | fp32")
    r.add_argument("--variant", default="baseline", help="baseline | efficient")
    r.add_argument("--recompute", default="none",
                   help="efficient only: none | mlp (keep the block input, the attention branch and SDPA's "
                        "tensors; re-run both norms, gate_up and the activation in backward)")
    p.add_argument("--json", action="store_true", help="machine-readable output (keys in the README)")


def config_from_args(a) -> ModelConfig:
    if a.preset and a.hf_config:
        raise ConfigError("give --preset or --hf-config, not both")
    explicit = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                                           "tie_embeddings", "mlp") if getattr(a, k) is not None}
    if a.hf_config:
        base = from_hf_config(a.hf_config)
    elif a.preset or not explicit:
        base = ModelConfig.from_name(a.preset or DEFAULT_PRESET)
    else:
        base = None
    if base is None:
        missing = [k for k in ("hidden", "layers", "heads", "intermediate", "vocab") if k not in explicit]
        if missing:
            raise ConfigError(f"without --preset, give --{' --'.join(m.replace('_', '-') for m in missing)}")
        return ModelConfig(**explicit)
    d = base.to_dict()
    if "heads" in explicit and "kv_heads" not in explicit:
        d["kv_heads"] = None
    d.update(explicit)
    if explicit:
        d["name"] = f"{base.name}+custom"
    return ModelConfig(**d)


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

        if a.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {a.world_size}")
        strategy = a.strategy or ("fsdp" if a.variant == "efficient" else "ddp")
        out["distributed"] = estimate_distributed(cfg, run, a.world_size, strategy)
    if a.gpu is not None:
        from anatomy.calculator.timing import estimate_time

        t = estimate_time(cfg, run, a.variant, gpu=a.gpu)
        out["time"] = {k: t[k] for k in ("forward_backward_s", "optimizer_s", "step_s", "steady", "host_bound", "mfu",
                                         "components", "sources")
                       if k in t} | {"gpu": a.gpu, "profile": t["gpu"], "profile_kind": t["profile_kind"]}
        gpu_s = {ph: v["gpu_s"] for ph, v in t["phases"].items()}  # the kernels' time, the GPU's idle time left out
        out["time"]["gpu_busy_s"] = dict(forward_backward=gpu_s["forward"] + gpu_s["backward"],
                                         step=sum(gpu_s.values()))
        from anatomy.calculator.timing import lookup as gpus

        cap = gpus.get(a.gpu)["memory_GB"] * 1e9  # does the predicted peak fit the GPU's memory?
        need = max(ph["forward_peak"] or 0, ph["backward_peak"])
        out["memory"]["fits"] = dict(gpu=a.gpu, need_bytes=need, capacity_bytes=int(cap), fits=need <= cap)
    return out


def _fits(cfg, run, variant, device) -> bool:
    """A predicted OOM is avoided, not crashed into: will the saved tensors fit in a quarter of memory?"""
    from anatomy.calculator import estimate

    need = estimate(cfg, run, variant).to_dict()["memory"]["saved"]["total"] + 4 * 4 * estimate(cfg, run, variant).params
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return need < 0.8 * free
    return need < 0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _measurable_run(cfg, run, variant, device) -> Run:
    r = run
    while not _fits(cfg, r, variant, device):
        if r.batch > 1:
            r = Run(batch=1, seq=r.seq, dtype=r.dtype, recompute=r.recompute)
        elif r.seq > 16:
            r = Run(batch=1, seq=r.seq // 2, dtype=r.dtype, recompute=r.recompute)
        else:
            break
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
    return measure(cfg, run, a.variant, dev, saved_run=sr)


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
    from rich.table import Table

    con = Console()
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
        con.print_json(json.dumps(out))
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
                      "one (docs/timing.md, sessions 9-14), while its kernel time held to ±10%")
        from anatomy.calculator.timing import lookup as gpus

        measured = f"{gpus.profile_stem(tm['profile'])}-measured"
        if tm["profile_kind"] == "datasheet" and measured in gpus.names():
            con.print(f"(from datasheet figures; --gpu {measured} uses the profile `anatomy calibrate` measured on "
                      "one, which the H200 claims are checked against: docs/timing.md)")
    if "distributed" in out:
        d = out["distributed"]
        con.print_json(json.dumps({k: d[k] for k in ("memory", "collectives", "comm") if k in d}))


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
            print(f"anatomy report: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        reports = report.load(a.claims)
        readme = Path(a.readme)
        report.write_atomic(readme, report.replace_between(readme.read_text(), a.marker, report.claims_table(reports)))
    except (OSError, ValueError, KeyError) as e:
        print(f"anatomy report: error: {e}", file=sys.stderr)
        return 2
    print(f"updated {a.readme} ({a.marker}) from {len(reports)} report(s)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return cmd_report(argv[1:])
    if argv[:1] == ["train"]:
        from anatomy.train.cli import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["sweep"]:
        from anatomy.sweep import main as sweep_main

        return sweep_main(argv[1:])
    if argv[:1] == ["forensics"]:
        from anatomy.measure.forensics import main as forensics_main

        return forensics_main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from anatomy.measure.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    p = _Parser(prog="anatomy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name in COMMANDS:
        sp = sub.add_parser(name, help=COMMANDS[name].__name__)
        _add_config_flags(sp)
        sp.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if present, else cpu")
        if name == "estimate":
            sp.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (per-rank memory, comm)")
            sp.add_argument("--strategy", choices=("ddp", "fsdp"),
                            help="default: ddp for the baseline, fsdp for the efficient variant")
            sp.add_argument("--gpu", help="predict step time on this GPU: a name (H200, H100, A100-80GB, RTX4090, "
                                          "h200-measured, ...) or a profile JSON from `anatomy calibrate`")
    sub.add_parser("report", help="regenerate README tables from claims JSON (see: anatomy report -h)")
    sub.add_parser("train", help="train a model (see: anatomy train -h)")
    sub.add_parser("sweep", help="estimate (and measure) over a config grid (see: anatomy sweep -h)")
    sub.add_parser("forensics", help="on a GPU: memory phases and what is live at the peak (see: anatomy forensics -h)")
    sub.add_parser("calibrate", help="measure this GPU's profile for the timing model (see: anatomy calibrate -h)")
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
        run = Run(batch=a.batch, seq=a.seq, dtype=a.dtype, recompute=a.recompute)
        if run.recompute != "none" and a.variant != "efficient":
            raise ConfigError(f"--recompute {run.recompute} is an option of the efficient variant (--variant efficient)")
        out = COMMANDS[a.cmd](a, cfg, run)
    except ConfigError as e:
        print(f"anatomy: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        _print(a.cmd, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
