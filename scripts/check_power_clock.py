"""Offline check: does each kernel class's own power, measured alone, predict a training step's SM clock, and
would that clock predict the step's time better than the timing model's length rule? (records only, no GPU)

    python3 -m scripts.check_power_clock [--power reports/h200/power/clock-by-kernel-class.json] \\
        [--rows reports/h200/user-loop/seed-20261202 reports/h200/user-loop/seed-20261203] [--json out.json]

The power model, every figure from scripts/probe_power.py's record, none fitted to the rows:
  - a compute class (GEMM, attention) draws idle + a·f at SM clock f, a = (its settled power - idle) / its
    settled clock: the power controller held each at the board's limit;
  - the copy and the launch-bound load draw their own measured power at boost, whatever the clock;
  - idle time (the model's step minus its kernel time) draws idle power.
A step's kernels are split into those classes by the timing model's own burst terms (roofline.step_terms:
the larger of compute and memory time, launches apart), its compute time stretched by 1980 / f. The clock is
the highest f <= the maximum at which the step's mean power is at most the limit.

Each row of a user-loop record (scripts/probe_timing.py --user-loop, with its machine's calibrated profile)
then gets three forward+backward kernel-time predictions: the length rule (the model as it is), the weight
the power model's clock implies, and the weight the row's own measured clock implies (llm_anatomy.
real_depth.clock_weight). Printed: the clock's error and correlation, and each weight's error per variant.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.io import write_atomic

POWER = records.POWER_PROBE  # each kernel class's rate, clock and power, alone, at the power limit
# the user-loop runs docs/timing.md quotes: the two drawn before the packaged profile changed
ROWS = [p.parent for p in records.REAL_DEPTH_RUNS[:2]]
COMPUTE = ("matmul", "attention")


class PowerModel:
    def __init__(self, doc: dict):
        c = doc["classes"]
        self.limit, self.top = doc["limits"]["power_limit_W"], doc["limits"]["max_clock_MHz"]
        self.idle = statistics.mean(c[k]["idle_W"] for k in c)
        self.per_mhz = {k: (c[k]["power_W"] - self.idle) / c[k]["clock_MHz"] for k in COMPUTE}  # W per MHz
        self.flat = {k: c[k]["power_W"] for k in ("memory", "launch")}

    def power(self, t: dict, idle_s: float, f: float) -> float:
        """Mean board power (W) of a step with t[class] seconds at the maximum clock, run at f MHz."""
        s = {k: v * (self.top / f if k in COMPUTE else 1.0) for k, v in t.items()}
        joules = (sum(s[k] * (self.idle + self.per_mhz[k] * f) for k in COMPUTE)
                  + sum(s[k] * self.flat[k] for k in self.flat) + idle_s * self.idle)
        return joules / (sum(s.values()) + idle_s)

    def clock(self, t: dict, idle_s: float) -> float:
        """The highest SM clock (MHz) at which the step's mean power is within the limit (bisection)."""
        if self.power(t, idle_s, self.top) <= self.limit:
            return self.top
        lo, hi = 100.0, self.top
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.power(t, idle_s, mid) <= self.limit else (lo, mid)
        return lo


def class_seconds(ks, prof) -> dict:
    """The step's GPU seconds at burst rates per class (roofline.step_terms' own terms)."""
    from llm_anatomy.calculator.timing.roofline import launch_term, step_terms

    terms, _ = step_terms(ks, prof)
    gap = launch_term(prof)
    t = dict.fromkeys((*COMPUTE, "memory", "launch"), 0.0)
    for k, (tc, tm, *_rest) in zip(ks, terms):
        if k.kind == "host":
            continue
        if tc > tm:
            t["attention" if k.kind == "sdpa" else "matmul"] += tc * k.count
        else:
            t["memory"] += tm * k.count
        t["launch"] += (prof.launch_s if prof.launch_s > max(tc, tm) else gap) * k.count
    return t


def fb_error(row: dict, gpu: str, weight: float | None) -> float:
    """(predicted - measured) / measured forward+backward kernel time, at this sustained weight (None: the rule)."""
    import llm_anatomy.calculator.timing as timing
    from llm_anatomy.real_depth import row_errors

    rule = timing.sustained_weight
    if weight is not None:
        timing.sustained_weight = lambda burst_s, tau_s: weight
    try:
        return row_errors(row, gpu)["GPU time, forward+backward"]
    finally:
        timing.sustained_weight = rule


def check(power_doc: dict, dirs: list[Path]) -> dict:
    from llm_anatomy.calculator.timing import estimate_time, get, kernels
    from llm_anatomy.real_depth import case_of, clock_weight

    pm, rows = PowerModel(power_doc), []
    for d in dirs:
        gpu = str(d / "calibrated.json")
        prof = get(gpu)
        burst, sustained = prof.clocks["burst_MHz"], prof.clocks["sustained_MHz"]
        for r in json.loads((d / "real-depth.json").read_text())["rows"]:
            if "error" in r:
                continue
            c = case_of(r)
            t = class_seconds(kernels(c.cfg, c.run, c.variant, None, "adamw"), prof)
            est = estimate_time(c.cfg, c.run, c.variant, gpu, optimizer="adamw", with_kernels=False)
            f = pm.clock(t, max(est["steady"]["step_s"] - est["gpu_s"], 0.0))
            w_power = min(1.0, max(0.0, (burst - f) / (burst - sustained)))
            rows.append(dict(record=d.name, id=r["id"], variant=c.variant, measured_MHz=r["clocks"]["sm_mhz"],
                             measured_W=r["clocks"]["power_w"], predicted_MHz=round(f, 1),
                             weights=dict(rule=est["sustained"]["weight"], power=w_power,
                                          clock=clock_weight(r, gpu)),
                             errors=dict(rule=fb_error(r, gpu, None), power=fb_error(r, gpu, w_power),
                                         clock=fb_error(r, gpu, clock_weight(r, gpu)))))
    miss = [x["predicted_MHz"] - x["measured_MHz"] for x in rows]
    summary = dict(n=len(rows), clock_rms_MHz=math.sqrt(statistics.mean(m * m for m in miss)),
                   clock_mean_MHz=statistics.mean(miss),
                   clock_correlation=statistics.correlation([x["measured_MHz"] for x in rows],
                                                            [x["predicted_MHz"] for x in rows]))
    for v in sorted({x["variant"] for x in rows}):
        for w in ("rule", "power", "clock"):
            e = [x["errors"][w] for x in rows if x["variant"] == v]
            summary[f"{v}/{w}"] = dict(n=len(e), mean=statistics.mean(e), mae=statistics.mean(map(abs, e)),
                                       worst=max(e, key=abs))
    return dict(power=str(power_doc.get("command", "")), summary=summary, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--power", type=Path, default=POWER, help="scripts/probe_power.py's JSON")
    ap.add_argument("--rows", type=Path, nargs="+", default=ROWS, help="user-loop record folders")
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    a = ap.parse_args(argv)
    try:
        doc = json.loads(a.power.read_text())
        missing = [d for d in a.rows if not (d / "real-depth.json").is_file() or not (d / "calibrated.json").is_file()]
        ok = (isinstance(doc, dict) and isinstance(doc.get("classes"), dict) and isinstance(doc.get("limits"), dict)
              and {"matmul", "attention", "memory", "launch"} <= set(doc["classes"]))
        if missing or not ok:
            raise ValueError(f"want a probe_power record (limits, all four classes) and folders with real-depth.json "
                             f"and calibrated.json; missing: {', '.join(map(str, missing)) or 'part of the record'}")
    except (OSError, ValueError) as e:
        print(f"check_power_clock: error: {e}", file=sys.stderr)
        return 2
    out = check(doc, a.rows)
    s = out["summary"]
    print(f"{s['n']} rows: clock predicted {s['clock_mean_MHz']:+.0f} MHz on average, rms {s['clock_rms_MHz']:.0f} "
          f"MHz, correlation {s['clock_correlation']:.2f}")
    for k, v in s.items():
        if isinstance(v, dict):
            print(f"  forward+backward, {k:20s} n {v['n']:3d}  mean {v['mean']:+.1%}  mae {v['mae']:.1%}  "
                  f"worst {v['worst']:+.1%}")
    if a.json:
        write_atomic(a.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
