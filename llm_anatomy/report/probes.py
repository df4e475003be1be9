"""The committed H200 probe rows against the calculator: the figures the README and docs/timing.md
quote, computed here from the JSON (never typed by hand), and the same helpers the claim tests use.

memory: scripts/probe_memory.py rows (phases from max_memory_allocated / memory_allocated, and the
        allocator trace's figures) against llm_anatomy.calculator.memory.phases.
timing: scripts/probe_timing.py rows (unmarked steps, and in-place per-component intervals) against
        llm_anatomy.calculator.timing.estimate_time, with the profile `anatomy calibrate` measured in
        the same run (host speed differs between machines of this kind by up to 1.8x).
"""
from __future__ import annotations

import json
import statistics
from functools import lru_cache
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.config import ModelConfig, Run

SPLIT, DEFAULT = "expandable segments", "default allocator"


def profile() -> str:
    """The profile calibrated in the same run as the timing probe's rows, which their claims are judged against."""
    return str(records.TIMING_PROBE_PROFILE)
# (the calculator's key, the probe's phase, "allocated" at its end or its "peak")
FIGURES = (("forward_end", "forward", "allocated"), ("forward_peak", "forward", "peak"),
           ("backward_peak", "backward", "peak"), ("backward_end", "backward", "allocated"),
           ("optimizer_end", "optimizer", "allocated"))
TRACE_TOL = 0.01  # the walk against the allocator's requested bytes (the goal)


def trace_accounts(pred: int, measured: int, trace: int | None) -> bool:
    """A miss against the allocator's figure that its own accounts explain: the walk matches the
    requested bytes (the trace's, or the requested_bytes counter's) within TRACE_TOL, and the
    allocator counted more than those."""
    return bool(trace) and abs(pred - trace) <= TRACE_TOL * trace and measured > trace


def rows(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text())["rows"] if "error" not in r] if path.exists() else []


def row_id(r: dict) -> str:
    return (f"{r['config']}-B{r['batch']}S{r['seq']}-{r['variant']}" + (f"-{r['optimizer']}" if r["optimizer"] else "")
            + (f"-recompute-{r['recompute']}" if r.get("recompute", "none") != "none" else "")
            + ("-lean" if r.get("lean") else ""))


# ---- memory -----------------------------------------------------------------------------------------
def memory_rows(alloc: str = SPLIT) -> list[dict]:
    """The probe rows under one allocator setting, each tagged with it."""
    return [dict(r, alloc=alloc) for f in records.MEMORY_PROBE[alloc] for r in rows(f)]


def recompute_rows() -> list[dict]:
    """Run.recompute="mlp" rows (efficient only), under expandable segments: named configs, 16 drawn small
    ones and 32 drawn training-sized ones."""
    return [dict(r, alloc=SPLIT) for f in records.MEMORY_PROBE_RECOMPUTE for r in rows(f)]


def lean_rows() -> list[dict]:
    """Run.lean rows (efficient only), under expandable segments: named configs and drawn training-sized ones."""
    return [dict(r, alloc=SPLIT) for f in records.MEMORY_PROBE_LEAN for r in rows(f)]


def recompute_summary() -> str:
    """The recompute rows' phase figures against the calculator, and the step benchmarks' peaks under
    recompute."""
    e = memory_errors(rows_=recompute_rows())
    if not e:
        return "(no probe rows committed)"
    heads = [json.loads(f.read_text()) for f in records.MEMORY_PROBE_RECOMPUTE]
    src = "; ".join(f"{h['gpu']}, torch {h['torch']}, CUDA {h['cuda']}, {h['date']}: `{records.command(h['command'])}`" for h in heads)
    steps = [f"`{records.rel(p)}` {err:+.2%}" for p, _, err in step_peak_errors() if "recompute" in p.name]
    return ("Phase memory under recompute, expandable segments, against `max_memory_allocated` "
            f"(`reports/h200/memory-probe/recompute-*.json`, {len({x['row'] for x in e})} rows): "
            f"{_stats([x['allocator'] for x in e])} (source: {src}). Step peaks: " + ", ".join(steps) + ".")


def requested(r: dict, phase: str, field: str) -> int | None:
    """The allocator's requested_bytes counter for a figure, where the probe recorded it."""
    p = {p["name"]: p for p in r["phases"]}[phase]
    return p.get("requested_peak" if field == "peak" else "requested")


def memory_errors(alloc: str = SPLIT, rows_: list[dict] | None = None) -> list[dict]:
    """One entry per (row, figure): the error against the allocator's figure and against the trace's,
    and the allocator's slack over its requested_bytes counter. rows_: these rows instead of the probe's."""
    from llm_anatomy.calculator.memory import phases

    out = []
    for r in memory_rows(alloc) if rows_ is None else rows_:
        ph = {p["name"]: p for p in r["phases"]}
        pred = phases(ModelConfig(**r["cfg"]), Run.from_record(r),
                      r["variant"], r["optimizer"])
        for key, phase, field in FIGURES:
            if phase in ph and pred.get(key) is not None:
                m, t, q = ph[phase][field], r.get("trace", {}).get(key), requested(r, phase, field)
                out.append(dict(row=row_id(r), key=key, allocator=(pred[key] - m) / m,
                                trace=(pred[key] - t) / t if t else None, requested=(pred[key] - q) / q if q else None,
                                slack=(m - q) if q else None,
                                accounted=trace_accounts(pred[key], m, t) or trace_accounts(pred[key], m, q)))
    return out


def _stats(xs: list[float]) -> str:
    return (f"{sum(abs(x) <= 0.03 for x in xs)} of {len(xs)} within ±3% ({sum(abs(x) <= 0.01 for x in xs)} within "
            f"±1%), mean |error| {statistics.mean(map(abs, xs)):.3%}, worst {max(xs, key=abs):+.2%}")


def memory_summary() -> str:
    e, d = memory_errors(SPLIT), memory_errors(DEFAULT)
    if not e:
        return "(no probe rows committed)"
    tr = [x["trace"] for x in e if x["trace"] is not None]
    al = [x["allocator"] for x in e]
    bp = [x["allocator"] for x in e if x["key"] == "backward_peak"]
    dal = [x["allocator"] for x in d]
    miss = [x for x in d if abs(x["allocator"]) > 0.03]
    explained = [x for x in miss if x["accounted"]]
    n_rows = len({x["row"] for x in e})
    out = (f"{n_rows} rows (`reports/h200/memory-probe/`: named configs with and without AdamW, and drawn "
           f"configs, both variants), {len(e)} phase figures, with "
           f"`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (the allocator splits every block it reuses).\n"
           f"- Against `max_memory_allocated` / `memory_allocated`: {_stats(al)}. The peak inside backward alone: "
           f"{_stats(bp)}.\n"
           f"- Against the allocator's trace (every block at its requested size): {_stats(tr)}.\n")
    if d:
        out += (f"- The same rows under the default allocator settings: {_stats(dal)}. In {len(explained)} of the "
                f"{len(miss)} misses the allocator's own requested_bytes counter, read in the same run, is what the "
                f"walk matches (within ±1%), and the allocated figure is "
                f"{min((x['slack'] for x in explained), default=0) / 2**20:.1f}-"
                f"{max((x['slack'] for x in explained), default=0) / 2**20:.1f} MiB above it: cached blocks handed out "
                f"whole (the default splits a large block only when more than 1 MiB would remain).\n")
    res = reserved_ratios()
    out += (f"- `memory_reserved`, the looser figure: the calculator's range is [peak, 1.4 x peak + 128 MiB], its "
            f"slack fitted on an earlier probe of these configs (here, reserved - 128 MiB over the predicted peak: "
            f"median {res['median']:.2f}x, "
            f"worst {res['worst']:.2f}x); on the step benchmarks, outside that sample, reserved over peak is "
            f"{res['steps'][0]:.2f}-{res['steps'][1]:.2f}x.\n")
    return out + ("- Whole-step peaks of the step benchmarks (`bench/step.py`, default allocator, configs the probe "
                  "never ran): " + ", ".join(f"`{records.rel(p)}` {err:+.2%}" for p, _, err in step_peak_errors()) + ".")


def reserved_ratios() -> dict:
    """(reserved - 128 MiB) / predicted step peak over the probe rows' phases (both allocator settings),
    and reserved / predicted peak over the step benchmarks."""
    from llm_anatomy.calculator.memory import RESERVED_FIXED, phases

    def peak(p):
        return max(p["forward_peak"] or 0, p["backward_peak"], p["forward_end"])

    r = [(p["reserved"] - RESERVED_FIXED) / peak(phases(ModelConfig(**row["cfg"]), Run.from_record(row),
                                                         row["variant"], row["optimizer"]))
         for alloc in (SPLIT, DEFAULT) for row in memory_rows(alloc) for p in row["phases"] if p["name"] != "init"]
    steps = []
    for path, variant in step_records():
        rec = json.loads(path.read_text())
        steps.append(rec["reserved_mib"] * 2**20 / peak(phases(ModelConfig.from_name(rec["preset"]),
                                                             Run.from_record(rec), variant)))
    return dict(median=statistics.median(r), worst=max(r), steps=(min(steps), max(steps)))


# ---- the step benchmarks ---------------------------------------------------------------------------
def step_records() -> list[tuple[Path, str]]:
    """(path, variant) of every step record of our own models (bench/step.py: max_memory_allocated and the
    median time over 10 timed fwd+bwd steps of configs the probes never ran)."""
    return list(records.OWN_STEPS)


def step_peak_errors() -> list[tuple[Path, str, float]]:
    from llm_anatomy.calculator.memory import phases

    out = []
    for path, variant in step_records():
        rec = json.loads(path.read_text())
        ph = phases(ModelConfig.from_name(rec["preset"]), Run.from_record(rec), variant)
        m = rec["peak_mib"] * 2**20
        out.append((path, variant, (max(ph["forward_peak"] or 0, ph["backward_peak"]) - m) / m))
    return out


# ---- timing -----------------------------------------------------------------------------------------
def timing_rows() -> dict[str, list[dict]]:
    """{set: rows}: the named configs, the drawn training-sized ones (validations.configs
    .training_configs) and the drawn small ones (gpu_configs), each with the config it ran."""
    return {name: rows(path) for name, path in records.TIMING_PROBE.items()}


@lru_cache(maxsize=None)
def _predicted(cfg: str, batch: int, seq: int, variant: str, optimizer: str | None, profile: str,
               host_ms: float | None = None, loss_impl: str = "liger") -> dict:
    from llm_anatomy.calculator import timing

    prof = timing.get(profile)
    if host_ms and (prof.get("host_step") or {}).get(variant):  # a datasheet profile has nothing to scale from
        prof = timing.at_host_speed(prof, variant, host_ms)
    run = Run(batch, seq, "amp", loss_impl=loss_impl)
    return timing.estimate_time(ModelConfig(**json.loads(cfg)), run, variant, gpu=prof, optimizer=optimizer,
                                with_kernels=False)


def row_host_ms(r: dict) -> float | None:
    """The host's speed beside the row: the mean of its tiny host steps (calibrate_host.HostStep) timed right
    before and right after its unmarked steps, where the probe recorded them."""
    refs = r["timeline"].get("host_ref_ms")
    return statistics.mean(refs) if refs else None


def predicted(r: dict, profile: str, row_host: bool = True) -> dict:
    """The calculator's estimate for the row's config, against `profile`; with row_host (and a row that
    recorded it) at the host speed measured beside the row (timing.at_host_speed), not at calibration's.
    A datasheet profile has no tiny host step to scale from, and stays as it is."""
    host = row_host_ms(r) if row_host else None
    return _predicted(json.dumps(r["cfg"], sort_keys=True), r["batch"], r["seq"], r["variant"], r["optimizer"],
                      profile, host, Run.from_record(r).loss_impl)


def time_error(r: dict, what: str, profile: str, row_host: bool = True) -> float:
    """(predicted - measured) / measured of forward_backward or step, against the unmarked steps (run
    back to back: the prediction's `steady` figures)."""
    meas = r["timeline"][f"plain_{what}_ms"]
    return (predicted(r, profile, row_host)["steady"][f"{what}_s"] * 1e3 - meas) / meas


STEP_KEYS = ("forward+backward", "step", "GPU time, forward+backward", "GPU time, step")  # the rest: components
GPU_PHASES = {"forward_backward": ("forward", "backward"), "step": ("forward", "backward", "optimizer")}


def gpu_times_ms(r: dict, what: str, profile: str) -> tuple[float, float] | None:
    """(predicted, measured) ms of the step's GPU time: the predicted kernel time of its phases (forward +
    backward, and the optimizer for "step") and the kernel time the profiler recorded in them (r["kernels"],
    every component). Unlike the wall-clock step, it leaves out the GPU's idle time, which a host-bound row's
    host sets. None for a row the probe did not profile."""
    k = r.get("kernels", {}).get("components")
    if not k:
        return None
    phases = GPU_PHASES[what]
    return (sum(predicted(r, profile)["phases"][ph]["gpu_s"] for ph in phases) * 1e3,
            sum(c["ms"] for ph in phases for c in k.get(ph, {}).values()))


def gpu_time_error(r: dict, what: str, profile: str) -> float | None:
    """(predicted - measured) / measured of the step's GPU time (gpu_times_ms); None for an unprofiled row."""
    t = gpu_times_ms(r, what, profile)
    return None if t is None else (t[0] - t[1]) / t[1]


def component_errors(r: dict, profile: str, share: float = 0.05) -> dict[str, float]:
    """{"<component> <phase>": error} of the predicted GPU time of each component against the kernel
    time the profiler credited to it (r["kernels"], timeline.kernel_times), for the components that
    hold at least `share` of the step's measured kernel time ("other" is the residual adds)."""
    k = r.get("kernels", {}).get("components", {})
    total = sum(c["ms"] for ph in k.values() for c in ph.values())
    pred, out = predicted(r, profile)["components"], {}
    for ph in ("forward", "backward"):
        for comp, c in k.get(ph, {}).items():
            if c["ms"] >= share * total and comp in pred:
                out[f"{comp} {ph}"] = (pred[comp][f"{ph}_s"] * 1e3 - c["ms"]) / c["ms"]
    return out


def timing_table(rows_: list[dict], profile: str, row_host: bool = True) -> dict:
    """n, MAPE, worst and the count within ±10% (±15% per component) of forward + backward, of the
    step, and of each component's forward and backward GPU time (component_errors). row_host: the
    steps at the host speed measured beside each row (predicted), where the rows have it."""
    out: dict[str, list[float]] = {"forward+backward": [], "step": [], "GPU time, forward+backward": [],
                                   "GPU time, step": []}
    for r in rows_:
        out["forward+backward"].append(time_error(r, "forward_backward", profile, row_host))
        out["step"].append(time_error(r, "step", profile, row_host))
        for what in ("forward_backward", "step"):
            if (e := gpu_time_error(r, what, profile)) is not None:
                out[f"GPU time, {what.replace('_', '+')}"].append(e)
        for key, e in component_errors(r, profile).items():
            out.setdefault(key, []).append(e)
    tol = {"forward+backward": 0.10, "step": 0.10, "GPU time, forward+backward": 0.10, "GPU time, step": 0.10}
    return {k: dict(n=len(v), mape=sum(map(abs, v)) / len(v), worst=max(v, key=abs),
                    within=sum(abs(e) <= tol.get(k, 0.15) for e in v), tol=tol.get(k, 0.15)) for k, v in out.items() if v}


def timing_markdown() -> str:
    sets = timing_rows()
    lines = ["Rows: reports/h200/timing-probe/*.json (scripts/probe_timing.py), against the profile `anatomy calibrate` "
             "measured in the same run (reports/h200/timing-probe/profile.json) or the datasheet's; error "
             "= (predicted - measured) / measured. Steps: the unmarked steps' forward + backward (and AdamW step). "
             "Components: GPU kernel time from a torch.profiler trace, credited to the component marked before each "
             "launch; those holding ≥ 5% of the step's kernel time. Profile \"calibrated\": the host at the speed "
             "measured beside each row where the probe recorded it (calibrate's tiny host step right before and after "
             "the row's unmarked steps, `timing.at_host_speed`); \"host at calibration\": the profile's own host "
             "figures.", "",
             "| rows | variant | profile | quantity | n | within | MAPE | worst |", "|---|---|---|---|---:|---:|---:|---:|"]
    for name, rs in sets.items():
        for variant in ("efficient", "baseline"):
            vr = [r for r in rs if r["variant"] == variant]
            with_ref = any(row_host_ms(r) for r in vr)
            for label, prof, rh in (("calibrated", profile(), True), ("host at calibration", profile(), False),
                                    ("datasheet", "h200-sxm", False)):
                if label == "host at calibration" and not with_ref:
                    continue
                for k, v in timing_table(vr, prof, rh).items():
                    if label != "calibrated" and k not in ("forward+backward", "step"):
                        continue
                    lines.append(f"| {name} | {variant} | {label} | {k} | {v['n']} | {v['within']} (±{v['tol']:.0%}) | "
                                 f"{v['mape']:.1%} | {v['worst']:+.1%} |")
    return "\n".join(lines)


def timing_summary() -> str:
    sets = timing_rows()
    if not sets["named"]:
        return "(no probe rows committed)"
    prof = profile()

    def line(rs, what="forward+backward", prof=prof, row_host=True):
        t = timing_table(rs, prof, row_host).get(what)
        return f"{t['within']} of {t['n']} within ±10% (mean |error| {t['mape']:.1%}, worst {t['worst']:+.1%})"

    named = ", ".join(f"{r['config']} B{r['batch']} S{r['seq']} {r['variant']} {time_error(r, 'forward_backward', prof):+.1%}"
                      for r in sets["named"])
    out = ["Forward + backward against the profile calibrated in the same run (`reports/h200/timing-probe/`, "
           f"`reports/h200/timing-probe/profile.json`): named rows {named}."]
    for name in ("drawn, training-sized", "drawn, small"):
        for v in ("efficient", "baseline"):
            rs = [r for r in sets[name] if r["variant"] == v]
            if rs:
                out.append(f"- {name}, {v}: {line(rs)}.")
    gpu = [f"{name}, {v}: {line(rs, 'GPU time, step')}" for name in ("named", "drawn, training-sized")
           for v in ("efficient", "baseline") if (rs := [r for r in sets[name] if r["variant"] == v])]
    out.append("- The step's GPU time (forward, backward and AdamW: the predicted kernel time against the kernel time "
               "the profiler recorded, the GPU's idle time left out): " + "; ".join(gpu) + ".")
    for v in ("efficient", "baseline"):
        tr = [r for r in sets["drawn, training-sized"] if r["variant"] == v]
        comp = {k: x for k, x in timing_table(tr, prof).items() if k not in STEP_KEYS}
        if comp:
            out.append(f"- Per component (forward and backward GPU time against the profiler's kernel time, ±15%), "
                       f"drawn training-sized, {v}: {sum(x['within'] for x in comp.values())} of "
                       f"{sum(x['n'] for x in comp.values())} figures within ("
                       + ", ".join(f"{k} {x['within']}/{x['n']}" for k, x in sorted(comp.items())) + ").")
    if any(row_host_ms(r) for r in sets["named"] + sets["drawn, training-sized"]):
        calib = [f"{name}, {v}: {line(rs, 'step', prof, row_host=False)}" for name in ("named", "drawn, training-sized")
                 for v in ("efficient", "baseline") if (rs := [r for r in sets[name] if r["variant"] == v])]
        out.append("- Steps are predicted at the host speed measured beside each row (calibrate's tiny host step, right "
                   "before and after the row's unmarked steps). At the profile's own host figures, the steps "
                   "with optimizer: " + "; ".join(calib) + ".")
    ds = [time_error(r, "forward_backward", "h200-sxm") for r in sets["named"]]
    out.append(f"- Uncalibrated (datasheet profile), the named rows' mean |error| is {statistics.mean(map(abs, ds)):.0%}.")
    head = json.loads(records.TIMING_PROBE["drawn, training-sized"].read_text())
    out.append(f"- Source: {head['gpu']}, torch {head['torch']}, CUDA {head['cuda']}, {head['date']}: `{records.command(head['command'])}` "
               "(and the other sets' commands in their files), against the same run's `anatomy calibrate`.")
    return "\n".join(out)
