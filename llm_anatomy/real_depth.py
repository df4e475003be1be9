"""Real-depth validation cases: the models people train, at the depth and length they train them, and the
comparison of a user-loop record's rows against estimate_time.

A case is (config, run, variant). draw() (and validations/real_depth.py's hypothesis strategy) draws
LLaMA-style models of 12-32 layers and 0.5-8 B parameters, GQA and MHA, tied and untied, vocab 32k-128k
(multiples of 8 and not), sequence 1k-16k, each kept only where a step with AdamW fits one H200 by the
calculator's memory phases (with MLP recompute where the plain step does not fit and the variant has it).
preset_cases() are the named real presets
(llm_anatomy/config.py) on the same rule. The timing claims on these rows are out of sample: the timing model's
fit never saw them, and draw() takes a seed (ANATOMY_DRAW_SEED) chosen after the model's code is final.

Pure Python over the config (no torch): the GPU script (scripts/probe_timing.py --user-loop), the CPU claim
tests (validations/test_real_depth.py) and `anatomy report` (llm_anatomy/report/real_depth.py) read the same
cases and the same comparison.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from llm_anatomy.calculator import param_count
from llm_anatomy.calculator.memory import phases
from llm_anatomy.config import PRESETS, ModelConfig, Run

# torch.cuda.get_device_properties(0).total_memory of an H200 is ~139.8 GiB (the datasheet's "141 GB");
# a case's allocated peak must leave 15% of it to the CUDA context, the cuBLAS/cuDNN workspaces and the
# caching allocator's fragmentation (reserved over allocated: calculator/memory.reserved)
H200_CAPACITY = int(139.8 * 2**30)
HEADROOM = 0.85
PARAMS = (0.5e9, 8.0e9)
LAYERS = (12, 32)
SEQS = (1024, 2048, 4096, 8192, 16384)
TOKENS = (4096, 8192, 16384)  # tokens per step: a micro-batch of a real run on one GPU
VARIANTS = ("efficient", "baseline")
REAL_PRESETS = ("tinyllama-1.1b", "llama3.2-1b", "anchor-1b", "llama2-7b", "mistral-7b", "llama3-8b")
DEFAULT_SEED = 24  # the lead draws with a new seed (ANATOMY_DRAW_SEED) after the calibration code is final


class Case(NamedTuple):
    cfg: ModelConfig
    run: Run
    variant: str

    @property
    def id(self) -> str:
        rc = "" if self.run.recompute == "none" else f"-rc{self.run.recompute}"
        return f"{self.cfg.name}-B{self.run.batch}S{self.run.seq}-{self.variant}{rc}"


def peak_bytes(cfg: ModelConfig, run: Run, variant: str) -> int:
    """The step's allocated peak with AdamW (calculator/memory.py: forward, backward, optimizer state)."""
    return phases(cfg, run, variant, "adamw")["reserved_low"]


def fitting_run(cfg: ModelConfig, batch: int, seq: int, variant: str, capacity: int = H200_CAPACITY) -> Run | None:
    """The run of this shape that fits one GPU with AdamW: plain, else with MLP recompute (the efficient
    variant's option); None where neither fits."""
    for rc in ("none", "mlp") if variant == "efficient" else ("none",):
        run = Run(batch, seq, "amp", rc)
        if peak_bytes(cfg, run, variant) <= HEADROOM * capacity:
            return run
    return None


class Rejected(Exception):
    """A drawn shape outside the parameter range, or one that fits no GPU."""


def case_from(choice, integer, flag, capacity: int) -> Case:
    """One case from three primitive draws (hypothesis's or a seeded random.Random's): choice(options),
    integer(lo, hi) inclusive, flag(). Rejected where it is out of range or does not fit."""
    head_dim = choice([64, 128])
    hidden = choice([h for h in (1536, 2048, 2560, 3072, 3584, 4096, 5120) if h % head_dim == 0])
    heads = hidden // head_dim
    gqa = flag()
    kv = choice([d for d in (1, 2, 4, 8) if heads % d == 0 and d < heads]) if gqa else heads
    inter = 256 * integer(hidden * 10 // 1024, hidden * 14 // 1024)  # the MLP 2.5-3.5x wide, in steps of 256
    vocab = choice([32000, 32768, 50257, 65536, 100277, 128256]) if flag() else integer(32000, 128256)
    cfg = ModelConfig(name="real-depth", hidden=hidden, layers=integer(*LAYERS), heads=heads, kv_heads=kv,
                      intermediate=inter, vocab=vocab, tie_embeddings=flag(), rope_theta=choice([1e4, 5e5, 1e6]))
    n = param_count(cfg)
    if not PARAMS[0] <= n <= PARAMS[1]:
        raise Rejected
    seq = choice(list(SEQS))
    batch = max(1, choice(list(TOKENS)) // seq)
    variant = choice(list(VARIANTS))
    run = fitting_run(cfg, batch, seq, variant, capacity)
    if run is None:
        raise Rejected
    tag = (f"rd{n / 1e9:.1f}b-L{cfg.layers}H{hidden}{'g' + str(kv) if gqa else ''}V{vocab}"
           f"{'t' if cfg.tie_embeddings else ''}")
    return Case(ModelConfig(**dict(cfg.to_dict(), name=tag)), run, variant)


def draw_seed() -> int:
    """ANATOMY_DRAW_SEED, else DEFAULT_SEED; a value that is not an integer is a ValueError naming it."""
    raw = os.environ.get("ANATOMY_DRAW_SEED", "").strip()
    if not raw:
        return DEFAULT_SEED
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"ANATOMY_DRAW_SEED must be an integer, got {raw!r}") from None


def draw(n: int, seed: int | None = None, capacity: int = H200_CAPACITY) -> list[Case]:
    """n distinct real-depth cases drawn uniformly over the strategy's space from random.Random(seed): the
    same list for a seed on any machine and hypothesis version (hypothesis's own generation favours its
    simplest values, which a fixed list of validation rows must not)."""
    import random

    rng = random.Random(draw_seed() if seed is None else seed)
    out, seen = [], set()
    for _ in range(200 * n):
        if len(out) == n:
            break
        try:
            c = case_from(rng.choice, rng.randint, lambda: rng.random() < 0.5, capacity)
        except Rejected:
            continue
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


def preset_cases(capacity: int = H200_CAPACITY, batch: int = 1, seq: int = 4096) -> list[Case]:
    """The named real presets at B1 S4096 (the 7B-class rows among them), both variants, where they fit with AdamW
    (with MLP recompute where the efficient variant needs it)."""
    out = []
    for name in REAL_PRESETS:
        for variant in VARIANTS:
            run = fitting_run(PRESETS[name], batch, seq, variant, capacity)
            if run is not None:
                out.append(Case(PRESETS[name], run, variant))
    return out


# ---- the comparison (CPU): committed user-loop rows against estimate_time --------------------------------
QUANTITIES = ("forward_backward", "step", "wall")  # the claims of claim()
TOL = {"GPU time, forward+backward": 0.10, "GPU time, step": 0.10, "wall step (GPU-bound)": 0.10}
COMPONENT_TOL, COMPONENT_SHARE, GPU_BOUND_BUSY = 0.15, 0.05, 0.90


def case_of(row: dict) -> Case:
    return Case(ModelConfig(**row["cfg"]), Run(row["batch"], row["seq"], "amp", row.get("recompute", "none")),
                row["variant"])


def predicted(row: dict, gpu) -> dict:
    """estimate_time for a committed row, with fused AdamW (what the user's loop runs)."""
    from llm_anatomy.calculator.timing import estimate_time

    c = case_of(row)
    return estimate_time(c.cfg, c.run, c.variant, gpu, optimizer="adamw", with_kernels=False)


def predicted_busy(res: dict) -> float:
    """The model's GPU busy fraction of a back-to-back step: its kernel time over its steady step."""
    return res["gpu_s"] / res["steady"]["step_s"]


def row_errors(row: dict, gpu) -> dict[str, float]:
    """{quantity: (predicted - measured) / measured} of one row: the kernel time of forward + backward and of
    the step; the wall step where the model calls the row GPU-bound; each component's forward and backward
    kernel time where the row has them and the component holds >= COMPONENT_SHARE of the step's."""
    res, k = predicted(row, gpu), row["kernels"]
    fb = (res["phases"]["forward"]["gpu_s"] + res["phases"]["backward"]["gpu_s"]) * 1e3
    out = {"GPU time, forward+backward": fb / k["forward_backward_ms"] - 1,
           "GPU time, step": res["gpu_s"] * 1e3 / k["step_ms"] - 1}
    if predicted_busy(res) >= GPU_BOUND_BUSY:
        out["wall step (GPU-bound)"] = res["steady"]["step_s"] * 1e3 / row["wall"]["step_ms"] - 1
    comps = row.get("components") or {}
    total = sum(c["ms"] for ph in comps.values() for c in ph.values())
    for ph in ("forward", "backward"):
        for comp, c in comps.get(ph, {}).items():
            if c["ms"] >= COMPONENT_SHARE * total and comp in res["components"]:
                out[f"{comp} {ph}"] = res["components"][comp][f"{ph}_s"] * 1e3 / c["ms"] - 1
    return out


def claim(row: dict, what: str, gpu, note: str) -> dict | str:
    """The claim `what` (QUANTITIES) on one user-loop row against `gpu`: claim, predicted and measured ms,
    tolerance and note (`note` and the prediction's sustained weight and GPU busy fraction); or, for the wall
    step of a row the model calls host-bound, why it is not claimed."""
    res = predicted(row, gpu)
    busy = predicted_busy(res)
    cw, mhz = clock_weight(row, gpu), (row.get("clocks") or {}).get("sm_mhz")
    seen = f" (the row's SM clock, {mhz:.0f} MHz, implies {cw:.2f})" if cw is not None else ""
    note = f"{note}; sustained weight {res['sustained']['weight']:.2f}{seen}; GPU busy {busy:.0%} predicted"
    if what == "forward_backward":
        return dict(claim="time.real_depth.gpu.forward_backward", note=note,
                    predicted=(res["phases"]["forward"]["gpu_s"] + res["phases"]["backward"]["gpu_s"]) * 1e3,
                    measured=row["kernels"]["forward_backward_ms"], tolerance=TOL["GPU time, forward+backward"])
    if what == "step":
        return dict(claim="time.real_depth.gpu.step", predicted=res["gpu_s"] * 1e3, measured=row["kernels"]["step_ms"],
                    tolerance=TOL["GPU time, step"], note=note)
    pred = res["steady"]["step_s"] * 1e3
    if busy < GPU_BOUND_BUSY:
        return (f"host-bound by the model (GPU busy {busy:.0%} < 90%; measured {row['gpu_busy']:.0%}): "
                f"predicted {pred:.1f} ms, measured {row['wall']['step_ms']:.1f} ms; reported, not claimed")
    return dict(claim="time.real_depth.step", predicted=pred, measured=row["wall"]["step_ms"],
                tolerance=TOL["wall step (GPU-bound)"], note=note)


def clock_weight(row: dict, gpu) -> float | None:
    """The sustained weight the row's own SM clock implies, (burst - clock) / (burst - sustained) with the
    profile's clocks, in [0, 1]; None without clocks. Beside the model's weight it tests the blend itself."""
    from llm_anatomy.calculator.timing import get

    ck, c = get(gpu).clocks, (row.get("clocks") or {}).get("sm_mhz")
    b, s = ck.get("burst_MHz"), ck.get("sustained_MHz")
    if not (c and b and s) or b <= s:
        return None
    return min(1.0, max(0.0, (b - c) / (b - s)))


def error_table(rows: list[dict], gpu) -> dict[str, dict]:
    """{quantity: {n, within, tol, mape, worst}} over the rows that ran."""
    errs: dict[str, list[float]] = {}
    for r in rows:
        if "error" not in r:
            for q, e in row_errors(r, gpu).items():
                errs.setdefault(q, []).append(e)
    return {q: dict(n=len(v), within=sum(abs(e) <= TOL.get(q, COMPONENT_TOL) for e in v), tol=TOL.get(q, COMPONENT_TOL),
                    mape=sum(map(abs, v)) / len(v), worst=max(v, key=abs)) for q, v in errs.items()}


def markdown(rows: list[dict], profiles: dict) -> str:
    """The error table per variant and profile ({label: gpu}), e.g. calibrated beside datasheet."""
    lines = ["| variant | profile | quantity | n | within | MAPE | worst |", "|---|---|---|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        vr = [r for r in rows if r["variant"] == variant]
        for label, gpu in profiles.items():
            for q, v in error_table(vr, gpu).items():
                lines.append(f"| {variant} | {label} | {q} | {v['n']} | {v['within']} (±{v['tol']:.0%}) | "
                             f"{v['mape']:.1%} | {v['worst']:+.1%} |")
    gpu = next(iter(profiles.values()))
    lines += ["", "| case | step ms | SM MHz | W | sustained weight: model | from the row's clock |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            continue
        w, cw = predicted(r, gpu)["sustained"]["weight"], clock_weight(r, gpu)
        ck = r.get("clocks") or {}
        lines.append(f"| {r['id']} | {r['wall']['step_ms']:.1f} | {ck.get('sm_mhz') or '-'} | {ck.get('power_w') or '-'} | "
                     f"{w:.2f} | {'-' if cw is None else f'{cw:.2f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python3 -m llm_anatomy.real_depth RECORD.json: the error table of a user-loop run
    import json
    import sys
    from pathlib import Path

    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        print("usage: python3 -m llm_anatomy.real_depth RECORD.json (scripts/probe_timing.py --user-loop's output)",
              file=sys.stderr)
        sys.exit(2)
    rec = Path(sys.argv[1])
    prof = rec.with_name("calibrated.json")
    data = json.loads(rec.read_text())
    same_run = prof.is_file() and data.get("profile") == prof.name  # else calibrate failed: the packaged profile
    if not same_run:
        print(f"real_depth: no same-run profile ({data.get('profile', 'no profile')}): predicting with the packaged "
              "h200-measured, calibrated on another machine", file=sys.stderr)
    print(markdown(data["rows"], {"same-run": str(prof)} if same_run else {"packaged (not same-run)": "h200-measured"}
                   | {"datasheet": "h200-sxm"}))
