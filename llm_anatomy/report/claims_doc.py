"""docs/claims.md: every claim -> its formula -> the code it measures -> its test -> its data, in three hops.

The claim names, their tests and their devices come from the claims reports (records.CPU_CLAIMS,
records.gpu_claims()); formula and code come from FAMILIES below, one entry per family of claims, matched on
the claim's name. A reference is `path:symbol`; `resolve` finds the symbol where the path says, else in the
same folder (a renamed file), else anywhere under anatomy/ where it is defined once. A claim no entry matches
is listed with "formula: (unmapped)", and validations/test_report.py fails on it.
"""
from __future__ import annotations

import re
from collections import defaultdict
from functools import cache
from pathlib import Path

from llm_anatomy import records

# (claim name pattern, formula refs, code refs (the model or kernel code, then the instrument), data: the
# `records` names a recorded row reads). "-" as a formula: both sides are measured (an equality of two runs).
_MODELS = ["llm_anatomy/baseline/transformer.py:Transformer", "llm_anatomy/efficient/transformer.py:Transformer"]
_SAVED = ["llm_anatomy/calculator/__init__.py:estimate", "llm_anatomy/calculator/linear.py:linears_saved"]
_PHASES = ["llm_anatomy/calculator/memory.py:phases", "llm_anatomy/calculator/backward.py:walk"]
_GPU_MEMORY = ["llm_anatomy/measure/memory.py:measure_phases", "llm_anatomy/measure/memory.py:trace_phases"]
_TIME = ["llm_anatomy/calculator/timing.py:estimate_time"]
_TIMELINE = ["llm_anatomy/measure/timeline.py:component_times", "llm_anatomy/measure/timeline.py:kernel_times"]
_DIST = ["llm_anatomy/distributed/strategies.py:wrap"]
_TP = "llm_anatomy/distributed/tensor_parallel.py:parallelize"
_PP = "llm_anatomy/distributed/pipeline_step.py:train_pp"
_PPTP = "llm_anatomy/distributed/pipeline_tp.py:tp_stages"
FAMILIES: list[tuple[str, list[str], list[str], list[str]]] = [
    (r"^params equal Hugging Face", ["llm_anatomy/calculator/__init__.py:param_count"],
     ["llm_anatomy/hf_config.py:from_hf_config", *_MODELS], []),
    (r"^params equal the published", ["llm_anatomy/calculator/__init__.py:param_count"], ["llm_anatomy/config.py:PRESETS"], []),
    (r"^params$", ["llm_anatomy/calculator/__init__.py:param_count"],
     [*_MODELS, "llm_anatomy/measure/run.py:measure_params"], []),
    (r"^flops\.", ["llm_anatomy/calculator/__init__.py:estimate", "llm_anatomy/calculator/attention.py:_flops"],
     [*_MODELS, "llm_anatomy/measure/flops.py:count_flops"], []),
    (r"^fused CE", ["llm_anatomy/calculator/loss.py:efficient"], ["llm_anatomy/efficient/loss.py:LMHeadLoss"], []),
    (r"^gpt-oss MLP", ["llm_anatomy/calculator/mlp.py:baseline"],
     ["llm_anatomy/baseline/mlp.py:MLP", "llm_anatomy/measure/saved.py:SavedTensorTracer"], []),
    (r"recompute's saving", ["llm_anatomy/calculator/mlp.py:efficient_saved"],
     ["llm_anatomy/efficient/transformer.py:Block", "llm_anatomy/measure/saved.py:SavedTensorTracer"], []),
    (r"^saved storages aliasing|^saved v:", ["llm_anatomy/calculator/attention.py:efficient"],
     ["llm_anatomy/efficient/attention.py:Attention", "llm_anatomy/measure/saved.py:SavedTensorTracer"], []),
    (r"^saved bytes$", ["llm_anatomy/calculator/norm.py:efficient", "llm_anatomy/calculator/mlp.py:efficient_saved"],
     ["llm_anatomy/kernels/rms_norm.py:rms_norm", "llm_anatomy/kernels/swiglu.py:swiglu_packed",
      "llm_anatomy/kernels/rope.py:rope_qkv", "llm_anatomy/measure/saved.py:SavedTensorTracer"], []),
    (r"^memory\.saved by our fused linear CE", ["llm_anatomy/calculator/loss.py:efficient"],
     ["llm_anatomy/kernels/linear_ce.py:linear_cross_entropy", "bench/loss_memory.py:main"], ["LOSS_MEMORY"]),
    (r"^memory\.peak of a fwd\+bwd step with our fused linear CE", _PHASES, ["bench/loss_memory.py:main"],
     ["LOSS_MEMORY"]),
    (r"^memory\.saved|^saved-bytes reduction", _SAVED, [*_MODELS, "llm_anatomy/measure/saved.py:SavedTensorTracer"], []),
    (r"^memory\.reserved of a fwd\+bwd step", ["llm_anatomy/calculator/memory.py:reserved"], ["bench/step.py:main"],
     ["STEPS"]),
    (r"^memory\.reserved", ["llm_anatomy/calculator/memory.py:reserved"], _GPU_MEMORY, ["MEMORY_PROBE"]),
    (r"^memory\.peak of a fwd\+bwd step", _PHASES, ["bench/step.py:main"], ["STEPS"]),
    (r"^memory\.peak in backward: ", ["llm_anatomy/calculator/backward.py:walk"],
     ["llm_anatomy/measure/forensics.py:replay", "llm_anatomy/measure/liveness.py:record_step_live"], []),
    (r"^memory\.live|^memory\.peak in backward$", _PHASES, ["llm_anatomy/measure/liveness.py:measure_phases_live"], []),
    (r"^memory\.(peak|allocated|after)", _PHASES, _GPU_MEMORY,
     ["MEMORY_PROBE", "MEMORY_PROBE_RECOMPUTE", "MEMORY_PROBE_LEAN"]),
    (r"^the step fits in GPU memory", _PHASES, ["conftest.py:gpu_fits"], []),
    (r"^plan: ", ["llm_anatomy/plan.py:plan", "llm_anatomy/plan.py:peak_bytes"], ["scripts/check_plan.py:user_loop"],
     ["PLAN_CHECK"]),
    (r"^optimizer state bytes", ["llm_anatomy/calculator/optimizer.py:state_bytes"],
     ["llm_anatomy/optim/baseline.py:AdEMAMix", "llm_anatomy/optim/efficient.py:FusedAdEMAMix"], []),
    (r"^optimizer step bytes", ["llm_anatomy/calculator/timing/kernels.py:optimizer_step_bytes"],
     ["llm_anatomy/optim/baseline.py:AdEMAMix", "llm_anatomy/optim/efficient.py:FusedAdEMAMix"], []),
    (r"^optimizer step time", ["llm_anatomy/calculator/timing/kernels.py:optimizer_kernels"],
     ["llm_anatomy/optim/baseline.py:AdEMAMix", "llm_anatomy/optim/efficient.py:FusedAdEMAMix"], ["H200_PROFILE"]),
    (r"^tp per-rank saved", ["llm_anatomy/calculator/tensor_parallel.py:tp_saved"],
     [_TP, "llm_anatomy/distributed/tp_saved.py:LocalSavedTracer"], []),
    (r"^tp (per-rank|collective)", ["llm_anatomy/calculator/tensor_parallel.py:tp_rank_memory",
                                   "llm_anatomy/calculator/tensor_parallel.py:tp_collectives"],
     [_TP, "llm_anatomy/distributed/counting.py:CollectiveCounter"], []),
    (r"^pipeline (saved|chunks)", ["llm_anatomy/calculator/pipeline_schedule.py:saved_peak",
                                   "llm_anatomy/calculator/pipeline_schedule.py:in_flight"],
     [_PP, "llm_anatomy/distributed/saved_in_flight.py:SavedInFlight"], []),
    (r"^pipeline (per-rank|sends)", ["llm_anatomy/calculator/pipeline_parallel.py:pp_rank_memory",
                                     "llm_anatomy/calculator/pipeline_parallel.py:pp_collectives"],
     [_PP, "llm_anatomy/distributed/counting.py:CollectiveCounter"], []),
    (r"pipeline loss curve|^tp x fsdp loss", ["-"], [_PP, "llm_anatomy/distributed/mesh_step.py:train"], []),
    (r"^pp x tp (per-rank|collectives)", ["llm_anatomy/calculator/pipeline_parallel.py:pp_rank_memory",
                                          "llm_anatomy/calculator/pipeline_parallel.py:pp_collectives"],
     [_PPTP, "llm_anatomy/distributed/counting.py:CollectiveCounter"], []),
    (r"^pp x tp (saved|chunks)", ["llm_anatomy/calculator/pipeline_schedule.py:saved_peak",
                                  "llm_anatomy/calculator/pipeline_schedule.py:in_flight"],
     [_PPTP, "llm_anatomy/distributed/saved_in_flight.py:SavedInFlight"], []),
    (r"^PP 2 x TP 2 (loss curve|\(efficient\) loss)", ["-"], [_PP, _PPTP], []),
    (r"^pp x tp rank ", ["llm_anatomy/calculator/tp_memory.py:pp_phases"],
     ["llm_anatomy/distributed/mesh_peak.py:pp_peaks"], []),
    (r"^tp \(efficient", ["-"], [_TP, "llm_anatomy/distributed/tp_layout.py:to_rank_order"], []),
    (r"^tp \(gpt-oss attention\) loss", ["-"], [_TP, "llm_anatomy/distributed/mesh_step.py:train"], []),
    (r"^vocab-parallel linear CE loss", ["-"],
     ["llm_anatomy/kernels/linear_ce_tp.py:vocab_parallel_linear_cross_entropy",
      "llm_anatomy/kernels/linear_ce.py:linear_cross_entropy"], []),
    (r"^vocab-parallel linear CE peak", ["llm_anatomy/calculator/tensor_parallel.py:vocab_parallel_ce_bytes"],
     ["llm_anatomy/kernels/linear_ce_tp.py:vocab_parallel_linear_cross_entropy",
      "llm_anatomy/measure/liveness.py:LiveStorage"], []),
    (r"^one-rank mesh loss", ["-"], [_TP, _PP, _PPTP], []),
    (r"^one-rank mesh", ["llm_anatomy/calculator/tensor_parallel.py:tp_rank_memory",
                         "llm_anatomy/calculator/pipeline_parallel.py:pp_rank_memory"],
     [_TP, _PP, "llm_anatomy/distributed/counting.py:rank_memory"], []),
    (r"^tp rank ", ["llm_anatomy/calculator/tp_memory.py:tp_phases"], ["llm_anatomy/distributed/mesh_peak.py:tp_peaks"], []),
    (r"^ep(<dp)? rank ", ["llm_anatomy/calculator/ep_memory.py:ep_phases"],
     ["llm_anatomy/distributed/mesh_peak.py:ep_peaks"], []),
    (r"^ep(<dp)? (amp )?(gradient|loss) vs", ["-"], ["llm_anatomy/distributed/expert_parallel.py:parallelize_experts",
                                                    "llm_anatomy/distributed/expert_parallel.py:train"], []),
    (r"^ep(<dp)? (collective|per-rank)", ["llm_anatomy/calculator/expert_parallel.py:collectives",
                                         "llm_anatomy/calculator/expert_parallel.py:rank_memory",
                                         "llm_anatomy/calculator/expert_parallel.py:saved"],
     ["llm_anatomy/distributed/expert_parallel.py:train"], []),
    (r"^pp rank ", ["llm_anatomy/calculator/tp_memory.py:pp_phases"], ["llm_anatomy/distributed/mesh_peak.py:pp_peaks"], []),
    (r"^anatomy train (--tp|--pp|gradient norm)", ["-"], ["llm_anatomy/train/mesh.py:build_tp",
                                                         "llm_anatomy/train/mesh.py:Pipelined",
                                                         "llm_anatomy/train/loop.py:train"], []),
    (r"^active params per token", ["llm_anatomy/calculator/__init__.py:active_param_count"],
     ["llm_anatomy/hf_config.py:from_hf_config", *_MODELS], []),
    (r"^fsdp E<W (loss|gradient) vs", ["-"], ["llm_anatomy/distributed/strategies.py:shard_placement",
                                                "llm_anatomy/distributed/strategies.py:wrap"], []),
    (r"^fsdp (amp|bf16) efficient loss vs one process", ["-"], ["llm_anatomy/distributed/strategies.py:wrap",
                                                                 "llm_anatomy/efficient/moe.py:ExpertBias"], []),
    (r"^fsdp E<W ", ["llm_anatomy/calculator/fsdp_shards.py:fsdp_shard_dim",
                     "llm_anatomy/calculator/sharding.py:per_rank_memory",
                     "llm_anatomy/calculator/comm.py:fsdp_collectives", "llm_anatomy/calculator/sharding.py:per_rank_peak"],
     ["llm_anatomy/distributed/strategies.py:shard_placement", "llm_anatomy/distributed/peak.py:peaks"], []),
    (r"^per-rank ", ["llm_anatomy/calculator/sharding.py:per_rank_memory"],
     [*_DIST, "llm_anatomy/distributed/counting.py:rank_memory"], []),
    (r"^collective ", ["llm_anatomy/calculator/comm.py:ddp_collectives", "llm_anatomy/calculator/comm.py:fsdp_collectives"],
     [*_DIST, "llm_anatomy/distributed/counting.py:CollectiveCounter"], []),
    (r"ranks vs one process", ["-"], [*_DIST, "llm_anatomy/train/loop.py:train"], []),
    (r"^mean train loss", ["-"], ["llm_anatomy/train/loop.py:train", *_MODELS], []),
    (r"kill \+ resume", ["-"], ["llm_anatomy/train/checkpoint.py:save", "llm_anatomy/train/checkpoint.py:load"], []),
    (r"^time\.sdpa_kernel", ["llm_anatomy/calculator/timing/sdpa_schedule.py:kernel_s"],
     ["llm_anatomy/efficient/attention.py:Attention", *_TIMELINE], ["TIMING_PROBE", "TIMING_PROBE_PROFILE"]),
    (r"^step time", _TIME, ["bench/step.py:main"], ["STEPS", "H200_PROFILE"]),
    (r"^time\.derived_h100\.", ["llm_anatomy/calculator/timing/derived.py:derive", *_TIME],
     ["scripts/user_loop.py:measure", "scripts/probe_moe.py:step_row"], []),
    (r"^time\.real_depth\.", _TIME, ["scripts/user_loop.py:measure", "scripts/user_loop.py:kernel_ms"],
     ["REAL_DEPTH_RUNS"]),
    (r"^time\.", _TIME, _TIMELINE, ["TIMING_PROBE", "TIMING_PROBE_PROFILE"]),
]


@cache
def _defines(path: Path, symbol: str) -> bool:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return re.search(rf"^(\s*)(def|class)\s+{re.escape(symbol)}\b|^{re.escape(symbol)}\s*[:=]", text, re.M) is not None


def resolve(ref: str, root: Path | None = None) -> str | None:
    """`path:symbol` as it stands, or where the symbol moved (the same folder first, then anatomy/ where it
    is defined exactly once) in the checkout `root` (default: the records' checkout); None where it is
    nowhere to be found."""
    if ref == "-":
        return ref
    root = records.ROOT if root is None else root
    path, symbol = ref.split(":")
    if _defines(root / path, symbol):
        return ref
    for folder in (root / Path(path).parent, root / "llm_anatomy"):
        hits = sorted(p for p in folder.rglob("*.py") if _defines(p, symbol))
        if len(hits) == 1:
            return f"{hits[0].relative_to(root)}:{symbol}"
    return None


def family(claim: str) -> tuple[list[str], list[str], list[str]] | None:
    for pattern, formula, code, data in FAMILIES:
        if re.search(pattern, claim):
            return formula, code, data
    return None


def _refs(refs: list[str]) -> str:
    out = []
    for ref in refs:
        where = resolve(ref)
        out.append("both sides measured" if where == "-" else f"`{where}`" if where else f"`{ref}` (not found)")
    return "<br>".join(out)


def _data(names: list[str]) -> list[str]:
    """The committed records behind a claim (a record a GPU run has not yet written is left out)."""
    paths = []
    for name in names:
        v = getattr(records, name)
        for p in (v.values() if isinstance(v, dict) else [v]):
            paths += [f"`{records.rel(q)}`" for q in (p if isinstance(p, tuple) else [p]) if q.exists()]
    return list(dict.fromkeys(paths))


def _test(node: str) -> str:
    return node.split("[")[0]


def claims(reports: list[tuple[Path, dict]]) -> dict[str, dict]:
    """claim -> its devices, check counts, tests, and where its measured side comes from."""
    out: dict[str, dict] = defaultdict(lambda: dict(devices=set(), checks=0, tests=set(), sources=set(), runs=set()))
    gpu_runs = records.gpu_claims()
    for path, rep in reports:
        gpu_run = path in gpu_runs
        for r in rep["rows"]:
            c = out[r["claim"]]
            c["devices"].add(r["device"])
            c["checks"] += 1
            if r.get("test"):
                c["tests"].add(_test(r["test"]))
            if gpu_run:
                c["runs"].add(records.rel(path))
            c["sources"].add("gpu" if gpu_run else "recorded" if "recorded" in r["device"] or
                             r["device"].startswith("cuda") else "live")
    return out


def unmapped(reports: list[tuple[Path, dict]]) -> list[str]:
    return sorted(c for c in claims(reports) if family(c) is None)


def unresolved() -> list[str]:
    return sorted({ref for _, formula, code, _ in FAMILIES for ref in formula + code if resolve(ref) is None})


def render(reports: list[tuple[Path, dict]]) -> str:
    lines = ["# Claims: formula, code, test, data", "",
             "Generated by `anatomy report` (`llm_anatomy/report/claims_doc.py`) from "
             + ", ".join(f"`{records.rel(p)}`" for p, _ in reports) + "; do not edit by hand.",
             "",
             "Each claim the validation suite checks, with the calculator's formula that predicts it, the model or",
             "kernel code (and the instrument) whose measurement it is checked against, the tests that check it",
             "(`path::function`), and where the measured side comes from: computed live in the test, measured live",
             "by the GPU suite, or read from a committed record (`llm_anatomy/records.py`). Tolerances and results are",
             "in the claims tables of docs/results.md.",
             "",
             "| claim | devices | checks | formula | code | tests | data |",
             "|---|---|---:|---|---|---|---|"]
    for name, c in sorted(claims(reports).items()):
        fam = family(name)
        formula, code, data = fam if fam else (None, [], [])
        src = []
        if "live" in c["sources"]:
            src.append("computed live")
        if "gpu" in c["sources"]:
            src.append("measured live on the GPU (" + ", ".join(f"`{r}`" for r in sorted(c["runs"])) + ")")
        if "recorded" in c["sources"]:
            src += _data(data) or ["a committed record (unmapped)"]
        lines.append(f"| {name} | {', '.join(sorted(c['devices']))} | {c['checks']:,} | "
                     f"{_refs(formula) if formula else 'formula: (unmapped)'} | {_refs(code) or '–'} | "
                     f"{'<br>'.join(f'`{t}`' for t in sorted(c['tests'])) or '–'} | {'<br>'.join(src)} |")
    return "\n".join(lines) + "\n"
