"""A GPU's timing profile: every figure the timing model reads, its unit, and what measures it.

A profile is a frozen dataclass. A *datasheet* profile fills the fields from the GPU table's cited figures
(llm_anatomy/calculator/gpus.py, one source per entry) and names an assumption where a datasheet has no figure.
A *measured* profile is what `anatomy calibrate` wrote (llm_anatomy/measure/calibrate*.py): raw measurements
that fit.from_measured turns into the same fields, each field naming the calibrate function that measures
it. Fields a calibration did not measure keep the datasheet's figure, and `sources` says so.

check_measured validates a calibrated profile's every field by type, range and finiteness before it is
fitted; a bad file is a ConfigError of one line naming the file and the field. lookup.py finds profiles.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace

from llm_anatomy.calculator import clocks, gpus
from llm_anatomy.config import ConfigError, ModelConfig, oneline

# what a datasheet does not state, and the figure a datasheet profile uses instead
ASSUMED_LAUNCH_S = 3e-6  # ~3 us per kernel back to back on a full queue: typical of recent NVIDIA GPUs
ASSUMED_HOST_OP_S = 10e-6  # ~10 us of CPU per eager ATen op under autograd (dispatch, node, cudaLaunchKernel)
ASSUMED = dict(
    launch_s="assumption, not a measurement: ~3 us per kernel back to back on a full launch queue (typical of "
             "recent NVIDIA GPUs); calibrate.measure_launch measures it",
    host_op_s="assumption, not a measurement: ~10 us of CPU per eager ATen op under autograd (dispatch, autograd "
              "node, cudaLaunchKernel); calibrate_host.measure_host measures it",
    attention="no measured attention throughput in a datasheet profile: SDPA is timed as a matmul at the bf16 "
              "peak (a pure roofline, optimistic by design)",
    attention_masked="no measured attention throughput in a datasheet profile: the masked SDPA (sinks, windows) is "
                     "timed as a matmul at the bf16 peak, as the causal one (optimistic by design)",
    matmul_k_half="not modelled without measurements (0)",
    optimizer_host="not measured: an optimizer step's host time is one eager op (host_op_s) per kernel launch, "
                   "issued beside the GPU's work; calibrate_host.measure_optimizer_host measures the compiled "
                   "AdEMAMix step's call")


@dataclass(frozen=True, eq=False)
class Profile(Mapping):
    """The timing model's view of one GPU. Read as attributes or, for callers that treat it as a mapping,
    as prof["field"] / prof.get("field"). Each comment: unit; the `anatomy calibrate` function that measures
    it (module:function under llm_anatomy/measure/), then how a datasheet profile fills it."""
    name: str  # "h200-sxm" (datasheet) or "h200-measured"
    display: str  # "NVIDIA H200 SXM"
    kind: str  # "datasheet" | "measured"
    sms: int  # streaming multiprocessors, the unit of wave quantization; datasheet/whitepaper in both kinds
    memory_GB: float  # capacity, GB (1e9 B), as the datasheet states it
    peak_flops: dict  # {dtype: FLOP/s}, dense datasheet peak (bfloat16: tensor cores, fp32 accumulate)
    # {dtype: FLOP/s}: the asymptotic GEMM rate matmul_efficiency scales down; calibrate_kernels:measure_gemms_in_step
    # (calibrate:measure_matmuls without it), fitted by fit.fit_matmul; datasheet: the peak
    matmul_flops: dict
    matmul_k_half: float  # elements of K at which a GEMM's main loop reaches half its rate; same fit; datasheet: 0
    mfu_peak_flops: float  # FLOP/s, MFU's denominator: calibrate:measure_matmuls' best GEMM; datasheet: the peak
    hbm_Bps: float  # bytes read + written per second of a large device copy; calibrate:measure_copy
    launch_s: float  # GPU seconds per tiny kernel on a full queue; calibrate:measure_launch; datasheet: assumed
    host_op_s: float  # CPU seconds per eager ATen op under autograd; calibrate_host:measure_host; datasheet: assumed
    # {op: {phase: CPU seconds per call}} of our custom ops (calibrate_host:measure_host) and Liger's fused
    # linear CE (liger_ce: forward, chunk, backward; calibrate_host:measure_host_step)
    host_custom_s: dict = field(default_factory=dict)
    kernel_gap_s: float = 0.0  # idle seconds between dependent kernels of real size; calibrate_kernels:measure_kernel_gap
    # {implementation: {call_s, tensor_s, tensors, max_error}}: host seconds one optimizer step's call holds the
    # GPU back, call_s + tensor_s x its parameter tensors: its time before the step's first kernel (the step's
    # Python, Dynamo's guards, the wrappers), measured as the step's wall time less its kernels' GPU time
    # (calibrate_host:measure_optimizer_host), fitted by fit.optimizer_host_fit. Empty (a
    # datasheet profile, or a calibration without it): the step's host is one eager op per launch (host_op_s).
    optimizer_host: dict = field(default_factory=dict)
    # a tiny host-bound step: {cfg, batch, seq, dtype, <variant>: {forward_backward_ms}}; calibrate_host:measure_host_step
    host_step: dict = field(default_factory=dict)
    # {backend: {head_dim: {fwd, fwd_bwd: FLOP/s at a full wave, seq: {S: {fwd, fwd_bwd}}}}}; calibrate:measure_attention
    attention: dict = field(default_factory=dict)
    # {backend: {head_dim: {forward|backward: {a, o, c: seconds}}}}: the causal SDPA kernel's CTA schedule,
    # calibrate_sdpa:measure_sdpa_kernels, fitted by sdpa_schedule.fit
    sdpa_schedule: dict = field(default_factory=dict)
    # {called head dim: {fwd, fwd_bwd: FLOP/s at a full wave, seq: {S: {fwd, fwd_bwd}}}}: cuDNN's SDPA under an
    # additive mask (gpt-oss's sinks and windows: efficient/attention_sinks.py), another kernel than the causal
    # one (it skips no block); FLOPs as FlopCounterMode counts the call (S x keys x the head dim it is called
    # with, backward 2.5x); calibrate_sdpa:measure_masked_attention, fitted by fit.masked_table. Empty: a profile
    # with measured causal rates refuses masked attention (roofline.masked_rate); a datasheet one prices it at the
    # bf16 peak, as its causal SDPA
    attention_masked: dict = field(default_factory=dict)
    # [{op, width, tokens, ms, ...}]: GPU ms per call of the ops timed per width (registry.OPS);
    # calibrate_kernels:measure_fused
    fused_rows: tuple = ()
    # {alignment class: {m|n|k: rate ratio}} of bf16 GEMMs with a dimension not a multiple of 8 (an odd vocab);
    # calibrate:measure_vocab_matmuls, fit.misaligned_factors
    matmul_misaligned: dict = field(default_factory=dict)
    # {alignment class: {rate_flops, k_half}} of the fp32-accumulating grad_weight at a misaligned vocab (a
    # fallback kernel with its own main loop); calibrate:measure_vocab_matmuls, fit.misaligned_accumulate
    matmul_misaligned_accumulate: dict = field(default_factory=dict)
    matmul_fp32_accumulate: float = 1.0  # rate ratio of addmm(out_dtype=fp32) over bf16-out; measure_vocab_matmuls
    matmul_accumulate_bw: float = 1.0  # fraction of hbm_Bps an fp32 accumulator's epilogue moves at; same rows
    # fraction of hbm_Bps a widening cast (bf16 -> fp32, e.g. dW back to an fp32 weight's gradient under autocast)
    # moves at: torch runs it in its unrolled cast kernel, the narrowing cast and a plain copy vectorized;
    # calibrate:measure_upcast over measure_copy (1.0 where a profile has none)
    upcast_bw: float = 1.0
    matmul_fit: tuple = ()  # [{m, n, k, measured_tflops, model_tflops}]: the fit against its points (reports)
    # {"forward" | "backward": torch._grouped_mm's rate / the dense model's rate for one GEMM over its tile-rounded
    # rows}, dimensionless (calibrate_grouped:measure_grouped, fit.grouped_efficiency); empty: 1.0, the dense rate
    grouped_mm: dict = field(default_factory=dict)
    matmul_loop_fit: dict = field(default_factory=dict)  # {rate_flops, k_half} fitted to the loop's GEMMs (reports)
    # -- the sustained-load regime: a long step runs at the power-limited SM clock, short bursts at boost --
    # {"matmul" | "attention" | "memory": rate under sustained load / burst rate}, dimensionless; measured
    # by calibrate_sustained:measure_sustained (the same GEMM, SDPA and copy before and after a warm-up
    # that drives the GPU to its power-limited clock); datasheet: base / boost clock for compute, 1 for
    # memory (clocks.py). Empty: no sustained term.
    sustained_ratio: dict = field(default_factory=dict)
    # seconds: the time constant of the fall from burst to sustained rates under continuous load; a step
    # of GPU time T runs at rates blended by roofline.sustained_weight(T, tau).
    # calibrate_sustained:measure_sustained's warm-up trace, fitted by fit.fit_tau; datasheet: assumed
    sustained_tau_s: float = 0.0
    # {burst_MHz, sustained_MHz, burst_W, sustained_W, boost_MHz, base_MHz, tdp_W}: the clocks and power of
    # each regime (None where not read), for reports; measure_sustained or clocks.py
    clocks: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # {date, gpu, torch, ...} of the calibration
    sources: dict = field(default_factory=dict)  # {field: where its figure comes from}

    # -- the mapping view ------------------------------------------------------------------------------
    def __getitem__(self, key: str):
        if key not in _FIELD_SET:
            raise KeyError(key)
        return self.__dict__[key]

    def get(self, key: str, default=None):
        return self.__dict__[key] if key in _FIELD_SET else default

    def __iter__(self):
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in _FIELDS}

    def replace(self, **changes) -> Profile:
        return replace(self, **changes)


_FIELDS = tuple(f.name for f in fields(Profile))
_FIELD_SET = frozenset(_FIELDS)
_REQUIRED = tuple(f.name for f in fields(Profile) if f.default is MISSING and f.default_factory is MISSING)


def datasheet(name: str) -> Profile:
    """The datasheet profile of a GPU table entry: peaks, bandwidth and SMs as cited, the rest assumed."""
    e = gpus.entry(name)
    bf16, fp32 = e["bf16_tflops"] * 1e12, e["fp32_tflops"] * 1e12
    src = e["source"]
    sources = dict(peak_flops=src, hbm_Bps=src, memory_GB=src, sms=e["sms_source"], **ASSUMED)
    c, ratio, ck, tau = clocks.clock(e["name"]), {}, {}, 0.0
    if c is not None:  # the sustained-load term from the published clocks (clocks.py)
        boost, base, tdp, csrc = c
        ratio, tau = clocks.sustained_ratio(e["name"]), clocks.ASSUMED_TAU_S
        ck = dict(boost_MHz=boost, base_MHz=base, tdp_W=tdp, burst_MHz=boost, sustained_MHz=base)
        sources.update(sustained_ratio=f"base / boost clock ({base} / {boost} MHz at {tdp} W) for GEMMs and "
                                       f"attention: {csrc}; memory: {clocks.MEMORY_RATIO_SOURCE}",
                       sustained_tau_s=clocks.ASSUMED_TAU, clocks=csrc)
    return Profile(name=e["name"], display=e["display"], kind="datasheet", sms=e["sms"], memory_GB=e["memory_GB"],
                   peak_flops={"bfloat16": bf16, "float32": fp32}, matmul_flops={"bfloat16": bf16, "float32": fp32},
                   matmul_k_half=0.0, mfu_peak_flops=bf16, hbm_Bps=e["hbm_GBps"] * 1e9, launch_s=ASSUMED_LAUNCH_S,
                   host_op_s=ASSUMED_HOST_OP_S, sustained_ratio=ratio, sustained_tau_s=tau, clocks=ck,
                   sources=sources)


def from_dict(d: Mapping, where: str = "gpu profile") -> Profile:
    """A profile from a full mapping of its fields (a Profile, or a dict made from one and edited)."""
    unknown = sorted(set(d) - set(_FIELDS))
    missing = [k for k in _REQUIRED if k not in d]
    if unknown or missing:
        what = f"unknown field {unknown[0]!r}" if unknown else f"lacks {', '.join(missing)}"
        raise ConfigError(f"{where} {d.get('name', '?')!r}: {what}")
    return Profile(**{k: d[k] for k in _FIELDS if k in d})


# ---- validation of a measured profile ---------------------------------------------------------------
_POS, _NONNEG, _INT, _STR = "a finite number > 0", "a finite number >= 0", "an integer > 0", "a string"
_ROWS = {  # measurement list -> {key: kind} every row must carry
    "matmul_bf16": dict(m=_INT, n=_INT, k=_INT, tflops=_POS),
    "matmul_bf16_in_step": dict(m=_INT, n=_INT, k=_INT, tflops=_POS),
    "matmul_vocab": dict(op=_STR, rows=_INT, hidden=_INT, vocab=_INT, tflops=_POS),
    "attention": dict(backend=_STR, B=_INT, heads=_INT, S=_INT, hd=_INT, fwd_ms=_POS, fwd_bwd_ms=_POS),
    "attention_masked": dict(B=_INT, heads=_INT, kv_heads=_INT, S=_INT, keys=_INT, hd=_INT, pad=_NONNEG,
                             fwd_ms=_POS, fwd_bwd_ms=_POS),
    "attention_kernels": dict(backend=_STR, B=_INT, heads=_INT, S=_INT, hd=_INT, fwd_kernel_ms=_POS,
                              bwd_kernel_ms=_POS),
    "fused": dict(op=_STR, tokens=_INT, width=_INT, ms=_POS),
    "grouped_mm": dict(role=_STR, n=_INT, k=_INT, ms=_POS),
}
_SCALARS = dict(copy_tbps=_POS, launch_us=_POS, host_op_us=_POS, upcast_tbps=_POS)


def _ok(v, kind: str) -> bool:
    if kind == _STR:
        return isinstance(v, str) and bool(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if kind == _INT:
        return isinstance(v, int) and v > 0
    return math.isfinite(v) and (v > 0 if kind == _POS else v >= 0)


def _bad(where: str, name: str, kind: str, v) -> ConfigError:
    shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    return ConfigError(f"{where}: field {name} must be {kind}, got {shown}")


def _finite(where: str, name: str, v) -> None:
    """Every number anywhere in the file is finite (NaN and infinity are refused wherever they sit)."""
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(where, name, "finite", v)
    if isinstance(v, dict):
        for k, x in v.items():
            _finite(where, f"{name}.{k}", x)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _finite(where, f"{name}[{i}]", x)


def check_measured(data, where: str) -> dict:
    """The measured-profile object, checked field by field; a ConfigError naming `where` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: not a gpu profile (a JSON object with 'measurements')")
    if not isinstance(data.get("measurements"), dict):
        raise ConfigError(f"{where}: field measurements must be an object")
    _finite(where, "measurements", data["measurements"])
    base = data.get("base", "h200-sxm")
    if not isinstance(base, str) or gpus.key(base) is None:
        raise ConfigError(f"{where}: field base must name a datasheet GPU ({', '.join(gpus.GPUS)}), got {base!r}")
    for k in ("name", "kind"):
        if k in data and not _ok(data[k], _STR):
            raise _bad(where, k, _STR, data[k])
    if not isinstance(data.get("provenance", {}), dict):
        raise _bad(where, "provenance", "an object", data["provenance"])
    m = data["measurements"]
    for k, kind in _SCALARS.items():
        if k in m and not _ok(m[k], kind):
            raise _bad(where, f"measurements.{k}", kind, m[k])
    for k, need in _ROWS.items():
        rows = m.get(k)
        if rows is None:
            continue
        if not isinstance(rows, list):
            raise _bad(where, f"measurements.{k}", "a list of objects", rows)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise _bad(where, f"measurements.{k}[{i}]", "an object", r)
            for f, kind in need.items():
                if not _ok(r.get(f), kind):
                    raise _bad(where, f"measurements.{k}[{i}].{f}", kind, r.get(f))
    for i, r in enumerate(m.get("grouped_mm") or ()):  # each expert's rows: counts, not all zero
        rows = r.get("rows")
        if not (isinstance(rows, list) and rows and all(_ok(x, _NONNEG) and isinstance(x, int) for x in rows)
                and sum(rows) > 0):
            raise _bad(where, f"measurements.grouped_mm[{i}].rows", "a list of row counts per expert", rows)
    for i, r in enumerate(m.get("attention_masked") or ()):  # the call's shape: an int pad, S or S + 1 keys, GQA groups
        if not isinstance(r["pad"], int):
            raise _bad(where, f"measurements.attention_masked[{i}].pad", "an integer >= 0", r["pad"])
        if r["keys"] not in (r["S"], r["S"] + 1):
            raise _bad(where, f"measurements.attention_masked[{i}].keys", "S or S + 1", r["keys"])
        if r["heads"] % r["kv_heads"]:
            raise _bad(where, f"measurements.attention_masked[{i}].kv_heads", "a divisor of heads", r["kv_heads"])
    gap = m.get("kernel_gap")
    if gap is not None and not (isinstance(gap, dict) and _ok(gap.get("gap_us"), _NONNEG)):
        raise _bad(where, "measurements.kernel_gap.gap_us", _NONNEG, gap.get("gap_us") if isinstance(gap, dict) else gap)
    hc = m.get("host_custom_us")
    if hc is not None:
        if not isinstance(hc, dict):
            raise _bad(where, "measurements.host_custom_us", "an object", hc)
        for op, v in hc.items():
            if op == "source":
                continue
            if not isinstance(v, dict):
                raise _bad(where, f"measurements.host_custom_us.{op}", "an object", v)
            for ph, us in v.items():
                if isinstance(us, (int, float)) and not _ok(us, _POS):
                    raise _bad(where, f"measurements.host_custom_us.{op}.{ph}", _POS, us)
    if m.get("sustained") is not None:
        _check_sustained(where, m["sustained"])
    if m.get("optimizer_host") is not None:
        _check_optimizer_host(where, m["optimizer_host"])
    hs = m.get("host_step")
    if hs is not None:
        if not isinstance(hs, dict) or not isinstance(hs.get("cfg"), dict):
            raise _bad(where, "measurements.host_step.cfg", "an object", hs)
        try:
            ModelConfig(**hs["cfg"])
        except (ConfigError, TypeError, ValueError) as e:
            raise _bad(where, "measurements.host_step.cfg", "a model config (name, hidden, layers, heads, kv_heads, "
                       f"intermediate, vocab: {oneline(str(e))})", hs["cfg"]) from None
        for k in ("batch", "seq"):
            if not _ok(hs.get(k), _INT):
                raise _bad(where, f"measurements.host_step.{k}", _INT, hs.get(k))
        for v in ("baseline", "efficient"):
            if v in hs and not (isinstance(hs[v], dict) and _ok(hs[v].get("forward_backward_ms"), _POS)):
                raise _bad(where, f"measurements.host_step.{v}.forward_backward_ms", _POS, hs[v])
    return data


OPTIMIZER_HOST_IMPLS = ("ademamix-compiled",)  # the implementations whose call calibrate times whole


def _check_optimizer_host(where: str, oh) -> None:
    """measurements.optimizer_host (calibrate_host:measure_optimizer_host): {implementation: {rows: [{tensors > 0,
    us > 0}]}}, each implementation one of OPTIMIZER_HOST_IMPLS with rows at two or more tensor counts."""
    name = "measurements.optimizer_host"
    if not isinstance(oh, dict):
        raise _bad(where, name, "an object", oh)
    for impl, rec in oh.items():
        if impl not in OPTIMIZER_HOST_IMPLS:
            raise _bad(where, f"{name}.{impl}", f"one of {', '.join(OPTIMIZER_HOST_IMPLS)}", impl)
        rows = rec.get("rows") if isinstance(rec, dict) else None
        if not isinstance(rows, list):
            raise _bad(where, f"{name}.{impl}.rows", "a list of objects", rows)
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise _bad(where, f"{name}.{impl}.rows[{i}]", "an object", r)
            for f, kind in (("tensors", _INT), ("us", _POS)):
                if not _ok(r.get(f), kind):
                    raise _bad(where, f"{name}.{impl}.rows[{i}].{f}", kind, r.get(f))
        if len({r["tensors"] for r in rows}) < 2:
            raise _bad(where, f"{name}.{impl}.rows", "rows at two or more tensor counts", rows)


SUSTAINED_RATES = dict(matmul="matmul_tflops", attention="attention_tflops", memory="copy_tbps")


def _check_sustained(where: str, s) -> None:
    """measurements.sustained (calibrate_sustained:measure_sustained): each regime's three rates > 0, its
    clock and power > 0 or null, and the warm-up trace's rows {t_s >= 0, tflops > 0}."""
    name = "measurements.sustained"
    if not isinstance(s, dict):
        raise _bad(where, name, "an object", s)
    for regime in ("burst", "sustained"):
        r = s.get(regime)
        if not isinstance(r, dict):
            raise _bad(where, f"{name}.{regime}", "an object", r)
        for k in SUSTAINED_RATES.values():
            if not _ok(r.get(k), _POS):
                raise _bad(where, f"{name}.{regime}.{k}", _POS, r.get(k))
        for k in ("clock_MHz", "power_W"):
            if r.get(k) is not None and not _ok(r[k], _POS):
                raise _bad(where, f"{name}.{regime}.{k}", _POS + " or null", r[k])
    trace = s.get("trace")
    if not isinstance(trace, list) or len(trace) < 2:
        raise _bad(where, f"{name}.trace", "a list of two or more objects", trace)
    for i, r in enumerate(trace):
        if not isinstance(r, dict):
            raise _bad(where, f"{name}.trace[{i}]", "an object", r)
        if not _ok(r.get("t_s"), _NONNEG):
            raise _bad(where, f"{name}.trace[{i}].t_s", _NONNEG, r.get("t_s"))
        if not _ok(r.get("tflops"), _POS):
            raise _bad(where, f"{name}.trace[{i}].tflops", _POS, r.get("tflops"))
    if not _ok(s.get("warmup_s"), _POS):
        raise _bad(where, f"{name}.warmup_s", _POS, s.get("warmup_s"))
    limits = s.get("limits", {})
    if not isinstance(limits, dict):
        raise _bad(where, f"{name}.limits", "an object", limits)
    for k, v in limits.items():
        if not _ok(v, _POS):
            raise _bad(where, f"{name}.limits.{k}", _POS, v)
    if not isinstance(s.get("settled", False), bool):
        raise _bad(where, f"{name}.settled", "true or false", s.get("settled"))
