"""`anatomy plan`: flags, the candidates table and the verdict (the search is llm_anatomy/plan.py)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from llm_anatomy.cli_args import (DEFAULT_VARIANT, Given, Parser, add_model_flags, add_optimizer_flag, config_from_args,
                                  nonempty)
from llm_anatomy.config import ConfigError, oneline
from llm_anatomy.plan import DEFAULT_MARGIN

GiB = 2**30
DESCRIPTION = ("find the fastest run of a model that fits a GPU: for each data-parallel strategy and recompute "
               "policy, the largest micro-batch whose predicted per-rank peak fits, its step time and tokens/s; "
               "from the calculator alone, nothing is built")


def parser() -> Parser:
    p = Parser(prog="anatomy plan", description=DESCRIPTION)
    add_model_flags(p)
    g = p.add_argument_group("run")
    g.add_argument("--gpu", required=True, type=nonempty, metavar="NAME|PATH",
                   help="the GPU: a table name (H100, A100-80GB, L40S, RTX4090, ...: a profile derived from the "
                        "measured H200, with a range; H200: its datasheet), <name>-datasheet, a measured profile "
                        "(h200-measured), or a profile JSON written by `anatomy calibrate`")
    g.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs in the data-parallel group")
    g.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="GPUs per node; beyond one node, collectives cross the inter-node network")
    g.add_argument("--seq", type=int, default=4096, metavar="N", action=Given, help="tokens per sequence")
    g.add_argument("--dtype", default="amp", type=nonempty,
                   help="amp (bf16 autocast, fp32 master weights), bf16 or fp32")
    g.add_argument("--variant", default=DEFAULT_VARIANT, type=nonempty, action=Given,
                   help="efficient (fused kernels) or baseline (unfused, readable)")
    g.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help="the efficient variant's lean block where it applies (recompute none); --no-lean plans the "
                        "plain block")
    add_optimizer_flag(g)
    g.add_argument("--strategy", choices=("ddp", "fsdp"),
                   help="plan only this data-parallel strategy (default: both, and the tensor- and pipeline-parallel "
                        "meshes, when --gpus > 1)")
    g.add_argument("--recompute", type=nonempty, metavar="POLICY[,POLICY]",
                   help="plan only these recompute policies (default: every policy of the variant: none, mlp, full "
                        "for efficient)")
    g.add_argument("--margin", type=float, default=0.05, metavar="FRACTION",
                   help="memory held back from the GPU's allocatable memory")
    g.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                   help="sequences per optimizer step over all GPUs: each rank accumulates gradients over its share "
                        "in micro-batches that fit")
    g.add_argument("--tokens", type=token_count, metavar="N",
                   help="a token budget to price: wall time and GPU-hours at the planned speed (15T, 300B, 2e12)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def token_count(text: str) -> float:
    """A number of tokens: a plain number or one with a K, M, B (or G) or T suffix."""
    t = text.strip().upper()
    try:
        v = float(t[:-1]) * _SUFFIX[t[-1]] if t and t[-1] in _SUFFIX else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r} (e.g. 15T, 300B, 2e12)") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"a token budget must be a positive number, got {text!r}")
    return v


def _model_args(a) -> list[str]:
    """The model flags as the user gave them, for the estimate command line."""
    out = []
    if a.hf_config:
        out += ["--hf-config", a.hf_config]
    elif a.preset:
        out += ["--preset", a.preset]
    for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "mlp"):
        if getattr(a, k) is not None:
            out += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    for k in ("tie_embeddings", "qkv_bias"):
        if getattr(a, k) is not None:
            out.append(f"--{'' if getattr(a, k) else 'no-'}{k.replace('_', '-')}")
    return out


def plan_command(a, kw: dict) -> str:
    """The `anatomy plan` command line for the plan() keywords kw (the user's model flags, then the run's)."""
    args = ["anatomy", "plan", *_model_args(a), "--gpu", kw["gpu"], "--gpus", str(kw["gpus_n"]), "--seq",
            str(kw["seq"]), "--dtype", kw["dtype"], "--variant", kw["variant"], "--optimizer", kw["optimizer"]]
    args += [] if kw["lean"] else ["--no-lean"]
    args += [] if kw["gpus_per_node"] == 8 else ["--gpus-per-node", str(kw["gpus_per_node"])]
    args += [] if kw["margin"] == DEFAULT_MARGIN else ["--margin", repr(kw["margin"])]
    args += ["--strategy", kw["strategies"][0]] if kw.get("strategies") else []
    args += ["--recompute", ",".join(kw["recomputes"])] if kw.get("recomputes") else []
    args += ["--global-batch", str(kw["global_batch"])] if kw.get("global_batch") else []
    args += ["--tokens", f"{kw['tokens']:g}"] if kw.get("tokens") else []
    return shlex.join(args)


def estimate_command(a, best: dict, plan: dict) -> str:
    """The `anatomy estimate` command line that details the planned run."""
    args = ["anatomy", "estimate", *_model_args(a), "--variant", plan["variant"], "--batch", str(best["micro_batch"]),
            "--seq", str(plan["seq"]), "--dtype", plan["dtype"], "--optimizer", plan["optimizer"], "--gpu", plan["gpu"]]
    if best["recompute"] != "none":
        args += ["--recompute", best["recompute"]]
    elif plan["variant"] == "efficient":
        args.append("--lean" if best["lean"] else "--no-lean")
    if plan["gpus"] > 1:
        args += ["--world-size", str(plan["gpus"]), "--strategy", best["strategy"],
                 "--gpus-per-node", str(plan["gpus_per_node"])]
    return shlex.join(args)


def render(a, out: dict) -> list[str]:
    """The candidates table and the verdict, as plain text lines (no markup: names are the user's)."""
    cfg, gib = out["config"], (lambda b: f"{b / GiB:,.2f}")
    block = " (lean block where recompute is none)" if out["lean"] else " (plain block)" \
        if out["variant"] == "efficient" else ""
    lines = [f"plan: {cfg['name']} · {out['variant']} variant{block} · {out['gpus']} x {out['gpu']} · "
             f"seq {out['seq']:,} · {out['dtype']} · {out['optimizer']}",
             f"per GPU: {gib(out['capacity_bytes'])} GiB allocatable ({out['capacity_source']}); budget "
             f"{gib(out['budget_bytes'])} GiB after a {out['margin']:.0%} margin"]
    if out["gpu_rule"]:
        lines.append(f"--gpu {out['gpu']}: {out['gpu_rule']}")
    if out["global_batch"]:
        lines.append(f"global batch {out['global_batch']:,} sequences per optimizer step: micro-batch x accumulation "
                     f"steps x {out['gpus']:,} GPUs; a step below is one optimizer step")
    head = ("strategy", "recompute", "micro-batch", "peak GiB/rank", "fits", "step ms", "exposed comm ms",
            "tokens/s", "MFU")
    rows = []
    for c in out["candidates"]:
        ok, timed = c["fits"], c["step_s"] is not None
        mb = f"{c['micro_batch']:,}" + (f" x {c['accum']:,}" if c["accum"] > 1 else "")
        rows.append((c["strategy"], c["recompute"] + (" (lean)" if c["lean"] else ""), mb if ok else "-", gib(c["peak_bytes"]),
                     "yes" if ok else "no (at 1)", f"{c['step_s'] * 1e3:,.1f}" if timed else "-",
                     f"{c['comm_exposed_s'] * 1e3:,.1f}" if timed else "-",
                     f"{c['tokens_per_s']:,.0f}" if timed else "-",
                     f"{c['mfu']:.1%}" if timed and c["mfu"] else "-"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(s.ljust(w) if i < 2 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines += ["", fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows), ""]
    lines += mesh_table(out)
    lines += [f"expert parallel not searched: {x}" for x in out.get("ep_skipped", [])]
    lines += [f"not planned: {x} not modelled yet" for x in out.get("skipped", [])]
    lines += [f"not timed: {x}" for x in out.get("untimed", [])]
    b = out["best"]
    if b is None and out.get("mesh_winner") is None:
        if fits := [c for c in out["candidates"] if c["fits"]]:  # it fits; this profile cannot time it
            top = fits[0]  # the table's order: the least recompute that fits
            return lines + [f"verdict: fits, not timed on {out['gpu']}: {top['strategy']}, recompute "
                            f"{top['recompute']}, micro-batch {top['micro_batch']:,}, {gib(top['peak_bytes'])} GiB "
                            f"per rank of {gib(out['budget_bytes'])} GiB (a profile with the rows named above "
                            "times it)"] + said_defaults(out)
        return lines + no_fit(out) + said_defaults(out)
    if (w := out.get("mesh_winner")) is not None:
        from llm_anatomy.plan_mesh import why

        lines.append(f"verdict: {w['mesh']}, recompute {w['recompute']}, micro-batch {w['micro_batch']:,} x "
                     f"{w['microbatches']:,} per step: {w['tokens_per_s']:,.0f} tokens/s "
                     f"({w['tokens_per_s'] / out['gpus']:,.0f} per GPU), {gib(w['peak_bytes'])} GiB on the heaviest "
                     f"rank of {gib(out['budget_bytes'])} GiB, step {w['step_s'] * 1e3:,.1f} ms")
        lines += ["  " + x for x in why(w, out["meshes"][1:])]
        if w.get("skewed_peak_bytes") is not None:
            lines.append(f"  its peak is under balanced routing; if every token chose experts 0..K-1 (skewed) rank 0 "
                         f"would receive ep x the rows and need {gib(w['skewed_peak_bytes'])} GiB")
        if b is not None:
            lines.append(f"  plain data parallelism ({b['strategy']}) reaches {b['tokens_per_s']:,.0f} tokens/s")
        if (bud := w["budget"]) is not None:
            lines.append(f"to train {tokens_text(bud['tokens'])} tokens: {days(bud)} on {out['gpus']:,} GPUs, "
                         f"{bud['gpu_hours']:,.0f} GPU-hours")
        return lines + said_defaults(out)
    lines.append(f"verdict: {b['strategy']}, recompute {b['recompute']}, micro-batch {b['micro_batch']:,}: "
                 f"{b['tokens_per_s']:,.0f} tokens/s, {gib(b['peak_bytes'])} GiB per rank of {gib(out['budget_bytes'])} "
                 f"GiB, step {b['step_s'] * 1e3:,.1f} ms")
    lines.append(f"details: {estimate_command(a, b, out)}")
    if out.get("meshes"):
        m = out["meshes"][0]
        from llm_anatomy.plan_mesh import NAMES, PARTS

        outside = ", ".join(f"{NAMES[k]} {m['parts'].get(k, 0.0) / m['step_s']:.0%}" for k in PARTS[1:-1]
                            if m["parts"].get(k, 0.0) / m["step_s"] >= 0.005) or "none above 0.5%"
        lines.append(f"  it beats the fastest mesh, {m['mesh']} ({m['tokens_per_s']:,.0f} tokens/s, recompute "
                     f"{m['recompute']}), which spends {1 - m['parts']['compute'] / m['step_s']:.0%} of its step "
                     f"outside compute: {outside}")
    if (bud := out["budget"]) is not None:
        lines.append(f"to train {tokens_text(bud['tokens'])} tokens: {days(bud)} on {out['gpus']:,} "
                     f"GPU{'s' if out['gpus'] > 1 else ''}, "
                     f"{bud['gpu_hours']:,.0f} GPU-hours" + (
                         f" (derived range {days(out['range']['high']['budget'])} to "
                         f"{days(out['range']['low']['budget'])})" if out.get("range") else ""))
    if (rg := out.get("range")) is not None:
        from llm_anatomy.calculator.timing.lookup import measured_hint

        lines.append(f"times from a derived profile (the measured H200's kernel efficiencies on {out['gpu']}'s "
                     f"datasheet, docs/derived-gpus.md): plausible range {rg['low']['tokens_per_s']:,.0f} to "
                     f"{rg['high']['tokens_per_s']:,.0f} tokens/s, MFU {rg['low']['mfu']:.1%} to {rg['high']['mfu']:.1%}; "
                     f"--gpu {out['gpu_entry']}-datasheet times the datasheet roofline" + measured_hint(out["gpu_entry"]))
    if out["profile_kind"] == "datasheet":
        lines.append(f"times from {out['gpu']}'s datasheet figures (no calibration: optimistic; a profile from "
                     "`anatomy calibrate` on the GPU, or h200-measured, is what the timing claims hold to)")
    lines.append("run it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the peaks are allocated bytes; "
                 "the default allocator's fragmentation can take part of the margin")
    return lines + said_defaults(out)


def mesh_table(out: dict, top: int = 8) -> list[str]:
    """The fastest tensor-, pipeline- and expert-parallel meshes that fit (plan_mesh.py), as text lines."""
    if not out.get("meshes"):
        return []
    gib = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    head = ("mesh", "recompute", "micro-batch x n", "peak GiB/rank", "step ms", "bubble", "all-to-all", "tokens/s",
            "MFU")
    rows = [(m["mesh"], m["recompute"] + (" (lean)" if m["lean"] else ""), f"{m['micro_batch']:,} x {m['microbatches']:,}",
             gib(m["peak_bytes"]), f"{m['step_s'] * 1e3:,.1f}", f"{m['parts']['bubble'] / m['step_s']:.0%}",
             f"{m['parts'].get('ep_comm', 0.0) / m['step_s']:.0%}",
             f"{m['tokens_per_s']:,.0f}", f"{m['mfu']:.1%}") for m in out["meshes"][:top]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    more = len(out["meshes"]) - top
    return [f"tensor-, pipeline- and expert-parallel meshes that fit, fastest first (calculator/mesh.py; {len(out['meshes'])} "
            "in all" + (f", {more} not shown" if more > 0 else "") + "; times unmeasured on several GPUs):",
            fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows), ""]


def tokens_text(n: float) -> str:
    """A token count as people write it: 15T, 300B, 1.5M."""
    for suffix, v in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= v:
            return f"{n / v:.4g}{suffix}"
    return f"{n:.4g}"


def days(budget: dict) -> str:
    """A training time in days, or hours when under two days."""
    return f"{budget['days']:,.1f} days" if budget["days"] >= 2 else f"{budget['seconds'] / 3600:,.1f} hours"


def said_defaults(out: dict) -> list[str]:
    """The line naming the defaults the plan took, if any."""
    if not out["defaults"]:
        return []
    took = ", ".join(f"{k} {v:,}" if k == "seq" else f"{k} {v}" for k, v in out["defaults"].items())
    return [f"defaults taken: {took} (--variant baseline plans the unfused model; --no-lean the plain efficient "
            "block)"]


def no_fit(out: dict) -> list[str]:
    """The verdict when nothing fits: the smallest need, the floor, and each change the search confirmed."""
    gib = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    least = min(out["candidates"], key=lambda c: c["peak_bytes"])
    adv = out["advice"]
    what = ("predicted OOM: nothing fits" if not out.get("skipped") else
            "nothing planned fits (the settings not planned above are not modelled, so not ruled out)")
    lines = [f"verdict: {what}. The smallest need is {gib(least['peak_bytes'])} GiB per rank "
             f"({least['strategy']}, recompute {least['recompute']}, micro-batch 1) against a budget of "
             f"{gib(out['budget_bytes'])} GiB.",
             f"weights, gradients and optimizer state alone: {gib(adv['floor_bytes'])} GiB per rank "
             f"({adv['floor_where']}), " + ("under the budget: activations are what does not fit" if adv["floor_fits"]
                                            else "over the budget: no micro-batch, recompute or --seq can fit")]
    if not adv["suggestions"]:
        return lines + ["no change searched fits (more GPUs, bf16 weights, a shorter --seq, a larger GPU)"]
    lines.append("what fits (each re-checked by this search):")
    for s in adv["suggestions"]:
        b = s["best"]
        lines.append(f"  {s['what']}: {b['strategy']}, recompute {b['recompute']}, micro-batch {b['micro_batch']:,}, "
                     f"{gib(b['peak_bytes'])} GiB per rank: {s['command']}")
    return lines


def main(argv=None) -> int:
    from llm_anatomy.plan import plan

    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
        recomputes = tuple(r.strip() for r in a.recompute.split(",")) if a.recompute else None
        kw = dict(gpu=a.gpu, seq=a.seq, gpus_n=a.gpus, gpus_per_node=a.gpus_per_node, optimizer=a.optimizer,
                  margin=a.margin, variant=a.variant, dtype=a.dtype, strategies=(a.strategy,) if a.strategy else None,
                  recomputes=recomputes, lean=a.lean, global_batch=a.global_batch, tokens=a.tokens)
        out = plan(cfg, **kw)
        given = getattr(a, "given", frozenset())
        out["defaults"] = {k: v for k, v in (("variant", a.variant), ("seq", a.seq)) if k not in given}
        if out["best"] is not None:
            out["estimate_command"] = estimate_command(a, out["best"], out)
        elif not any(c["fits"] for c in out["candidates"]):  # what would fit (a fitting row untimed needs none)
            from llm_anatomy.plan_advice import advise

            out["advice"] = advise(cfg, out, kw)
            for sug in out["advice"]["suggestions"]:
                sug["command"] = plan_command(a, kw | sug["changes"])
    except ConfigError as e:
        print(f"anatomy plan: error: {oneline(e)}", file=sys.stderr)
        return 2
    for note in a.config_notes:
        print(f"anatomy plan: note: {oneline(note)}", file=sys.stderr)
    print(json.dumps(out, indent=1) if a.json else "\n".join(render(a, out)))
    return 0


if __name__ == "__main__":
    from llm_anatomy.entry import guarded

    sys.exit(guarded("anatomy plan", main))
