"""GPU profiles for the timing model: datasheet peaks (each with its source), lookup, and the GEMM and
attention efficiency models; measured profiles are built by measured.py.

Pure Python: no torch. A profile is a plain dict (so it round-trips through JSON):

  name, display, kind        "h200-sxm", "NVIDIA H200 SXM", "datasheet" | "measured"
  sms                        streaming multiprocessors: the unit of wave quantization
  peak_flops[dtype]          dense datasheet peak (no 2:4 sparsity), FLOP/s; "bfloat16" is tensor-core
                             bf16 with fp32 accumulate, "float32" is plain fp32 (CUDA cores; torch's
                             default keeps TF32 off for matmuls)
  matmul_flops[dtype]        the asymptotic GEMM rate the efficiency model scales down (see
                             matmul_efficiency); datasheet: the peak; measured: fitted to the points
  matmul_k_half              K at which a GEMM's main loop reaches half its rate (prologue/epilogue
                             cost per output tile); 0 = none (datasheet: unknown, so not modelled)
  matmul_misaligned          measured only: {alignment class: {m|n|k: rate ratio}} of bf16 GEMMs with
                             a dimension not a multiple of 8 (an odd vocab), against the aligned rate
  mfu_peak_flops             the denominator of MFU: datasheet peak, or the measured ceiling
  hbm_Bps                    bandwidth of memory-bound kernels (bytes read + written per second)
  launch_s                   GPU-side cost per kernel launch on a full queue
  kernel_gap_s               (measured profiles) idle time between two dependent kernels of real size
  host_op_s, host_custom_s   CPU time to issue one eager ATen op / one custom op call (fwd, bwd)
  host_step                  measured only: a tiny step's config and its fwd+bwd ms per variant,
                             host-bound (timing.host_scale turns it into an in-step host factor)
  attention[backend][hd]     SDPA rates (causal FLOPs, fwd and fwd+bwd) normalised to a full wave
  sources[key]               where each figure comes from

Lookup is case-insensitive: "H200", "h200-sxm", "NVIDIA H200" name the datasheet profile;
"h200-measured" (or "h200:measured") the measured one; a path to a .json loads a profile written
by `anatomy calibrate`. An unknown name is a ConfigError (one line, exit 2 at the CLI).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from anatomy.config import ConfigError

PROFILE_DIR = Path(__file__).with_name("profiles")

# ---- sources -----------------------------------------------------------------------------------
A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
           "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
           "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: BF16 Tensor Core 312 TFLOPS (624 sparse), "
           "FP32 19.5 TFLOPS; SXM bandwidth 1,555 GB/s (40GB) / 2,039 GB/s (80GB)")
A100_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper, https://images.nvidia.com/aem-dam/en-zz/"
           "Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf: 108 SMs")
H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/"
           "nvidia-tensor-core-gpu-datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS with sparsity "
           "(989.4 dense), FP32 67 TFLOPS, 3.35 TB/s, 80 GB")
HOPPER_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, https://resources.nvidia.com/"
             "en-us-tensor-core/gtc22-whitepaper-hopper: H100 SXM5 132 SMs, dense BF16 989.4 TFLOPS, "
             "FP32 66.9 TFLOPS")
H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet / product page, https://www.nvidia.com/en-us/data-center/h200/: "
           "H200 SXM BF16 Tensor Core 1,979 TFLOPS with sparsity (989.4 dense: the H100's GH100 die and "
           "clocks), FP32 67 TFLOPS, 4.8 TB/s HBM3e, 141 GB")
GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper v2, https://www.nvidia.com/content/PDF/"
            "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf: RTX 3090 peak BF16 Tensor TFLOPS with "
            "FP32 accumulate 71 (142 sparse), FP32 35.6 TFLOPS, 936 GB/s, 82 SMs, 24 GB")
ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper v2.1, https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
          "nvidia-ada-gpu-architecture.pdf: RTX 4090 peak BF16 Tensor TFLOPS with FP32 accumulate 165.2 "
          "(330.4 sparse), FP32 82.6 TFLOPS, 1,008 GB/s, 128 SMs, 24 GB")
H100_PCIE_DS = ("NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/"
                "nvidia-tensor-core-gpu-datasheet: H100 PCIe BF16 Tensor Core 1,513 TFLOPS with sparsity "
                "(756.5 dense), FP32 51 TFLOPS, 2 TB/s, 80 GB; 114 SMs (14,592 CUDA cores / 128)")
L40S_DS = ("NVIDIA L40S product page / datasheet, https://www.nvidia.com/en-us/data-center/l40s/: BF16 Tensor "
           "Core 733 TFLOPS with sparsity (362.05 dense), FP32 91.6 TFLOPS, 864 GB/s, 48 GB; 142 SMs "
           "(18,176 CUDA cores / 128)")
L4_DS = ("NVIDIA L4 product page / datasheet, https://www.nvidia.com/en-us/data-center/l4/: BF16 Tensor Core "
         "242 TFLOPS with sparsity (121 dense), FP32 30.3 TFLOPS, 300 GB/s, 24 GB; 58 SMs (7,424 CUDA cores / 128)")
ASSUMED_LAUNCH = ("assumption, not a measurement: ~3 us per kernel back to back on a full launch queue "
                  "(typical of recent NVIDIA GPUs); `anatomy calibrate` measures it (tiny kernels queued behind a long one)")
ASSUMED_HOST = ("assumption, not a measurement: ~10 us of CPU per eager ATen op under autograd (dispatch, "
                "autograd node, cudaLaunchKernel); `anatomy calibrate` measures it")
ASSUMED_ATTENTION = ("no measured attention throughput in a datasheet profile: SDPA is timed as a matmul at "
                     "the bf16 peak (a pure roofline, optimistic by design)")


def _ds(name, display, sms, bf16_tflops, fp32_tflops, hbm_GBps, memory_GB, src, sms_src=None) -> dict:
    return dict(
        name=name, display=display, kind="datasheet", sms=sms, memory_GB=memory_GB,
        peak_flops={"bfloat16": bf16_tflops * 1e12, "float32": fp32_tflops * 1e12},
        matmul_flops={"bfloat16": bf16_tflops * 1e12, "float32": fp32_tflops * 1e12},
        matmul_k_half=0.0, mfu_peak_flops=bf16_tflops * 1e12, hbm_Bps=hbm_GBps * 1e9,
        launch_s=3e-6, host_op_s=10e-6, host_custom_s={}, attention={},
        sources=dict(peak_flops=src, hbm_Bps=src, memory_GB=src, sms=sms_src or src, launch_s=ASSUMED_LAUNCH,
                     host_op_s=ASSUMED_HOST, attention=ASSUMED_ATTENTION,
                     matmul_k_half="not modelled without measurements (0)"),
    )


DATASHEET: dict[str, dict] = {p["name"]: p for p in (
    _ds("a100-40gb-sxm", "NVIDIA A100 SXM 40GB", 108, 312.0, 19.5, 1555.0, 40, A100_DS, A100_WP),
    _ds("a100-80gb-sxm", "NVIDIA A100 SXM 80GB", 108, 312.0, 19.5, 2039.0, 80, A100_DS, A100_WP),
    _ds("h100-sxm", "NVIDIA H100 SXM", 132, 989.4, 66.9, 3350.0, 80, H100_DS, HOPPER_WP),
    _ds("h100-pcie", "NVIDIA H100 PCIe", 114, 756.5, 51.2, 2000.0, 80, H100_PCIE_DS),
    _ds("h200-sxm", "NVIDIA H200 SXM", 132, 989.4, 66.9, 4800.0, 141, H200_DS, HOPPER_WP),
    _ds("l40s", "NVIDIA L40S", 142, 362.05, 91.6, 864.0, 48, L40S_DS),
    _ds("l4", "NVIDIA L4", 58, 121.0, 30.3, 300.0, 24, L4_DS),
    _ds("rtx-3090", "NVIDIA GeForce RTX 3090", 82, 71.0, 35.6, 936.0, 24, GA102_WP),
    _ds("rtx-4090", "NVIDIA GeForce RTX 4090", 128, 165.2, 82.6, 1008.0, 24, ADA_WP),
)}

# measured profiles: profiles/<stem>.json is named "<stem>-measured" (`anatomy calibrate` writes them)
MEASURED_FILES = {f"{f.stem}-measured": f for f in sorted(PROFILE_DIR.glob("*.json"))}


def profile_stem(base: str) -> str:
    """The file stem a measured profile of a datasheet base is written under: h200-sxm -> h200."""
    return base.removesuffix("-sxm")

ALIASES = {
    "a100": "a100-80gb-sxm", "a100-sxm": "a100-80gb-sxm", "a100-80gb": "a100-80gb-sxm", "a100-40gb": "a100-40gb-sxm",
    "nvidia a100-sxm4-80gb": "a100-80gb-sxm", "nvidia a100-sxm4-40gb": "a100-40gb-sxm",
    "h100": "h100-sxm", "nvidia h100": "h100-sxm", "nvidia h100 80gb hbm3": "h100-sxm",
    "h200": "h200-sxm", "nvidia h200": "h200-sxm",
    "h200:measured": "h200-measured", "h200-sxm-measured": "h200-measured",
    "3090": "rtx-3090", "rtx3090": "rtx-3090", "nvidia geforce rtx 3090": "rtx-3090",
    "4090": "rtx-4090", "rtx4090": "rtx-4090", "nvidia geforce rtx 4090": "rtx-4090",
}


# torch.cuda.get_device_name() substring (lower case) -> datasheet profile; the first match wins
_DEVICE_NAMES = (("h200", "h200-sxm"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-sxm4-40gb", "a100-40gb-sxm"),
                 ("a100", "a100-80gb-sxm"), ("l40s", "l40s"), ("l4", "l4"), ("rtx 3090", "rtx-3090"),
                 ("rtx 4090", "rtx-4090"))


def for_device_name(device_name: str) -> dict | None:
    """The datasheet profile of a CUDA device by its reported name, or None if it is not in the table
    (the one table of peak FLOP/s: `anatomy train`'s MFU and the comm model read it too)."""
    low = device_name.lower()
    for sub, key in _DEVICE_NAMES:
        if sub in low:
            return get(key)
    return None


def names() -> list[str]:
    return [*DATASHEET, *MEASURED_FILES]


def get(gpu: str | dict | Path) -> dict:
    """A normalised profile: a datasheet name, a measured name, a profile .json path, or a dict
    (a full profile, or a measured-profile JSON object with "measurements")."""
    if isinstance(gpu, dict):
        if "measurements" in gpu:
            from anatomy.calculator.measured import from_measured  # (it builds on this module's datasheets)

            return from_measured(gpu)
        return _check(gpu)
    s = str(gpu)
    if s.endswith(".json"):
        return load(s)
    key = s.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key in DATASHEET:
        return json.loads(json.dumps(DATASHEET[key]))  # a deep copy: callers may edit theirs
    if key in MEASURED_FILES:
        return load(MEASURED_FILES[key])
    if key.endswith("-measured") and (PROFILE_DIR / f"{key.removesuffix('-measured')}.json").exists():
        return load(PROFILE_DIR / f"{key.removesuffix('-measured')}.json")
    raise ConfigError(f"unknown gpu {gpu!r}; choose from {', '.join(names())}, or a profile .json path")


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read gpu profile {str(path)!r}: {e}") from None
    if not isinstance(data, dict) or "measurements" not in data:
        raise ConfigError(f"{p}: not a measured gpu profile (no 'measurements')")
    from anatomy.calculator.measured import from_measured

    return from_measured(data)


_REQUIRED = ("name", "kind", "sms", "peak_flops", "matmul_flops", "matmul_k_half", "mfu_peak_flops", "hbm_Bps",
             "launch_s", "host_op_s", "host_custom_s", "attention", "sources")


def _check(p: dict) -> dict:
    missing = [k for k in _REQUIRED if k not in p]
    if missing:
        raise ConfigError(f"gpu profile {p.get('name', '?')!r} lacks {', '.join(missing)}")
    return p


# ---- the GEMM efficiency model -------------------------------------------------------------------
TILES = ((128, 128), (128, 256), (256, 128))  # CTA output tiles cuBLAS/CUTLASS pick among on Hopper
MAX_SPLIT_K = 16


def matmul_efficiency(m: int, n: int, k: int, sms: int, k_half: float = 0.0, batch: int = 1) -> float:
    """Fraction of the asymptotic GEMM rate a (batch x) m x n x k matmul can reach.

    Tile and wave quantization: C is cut into tm x tn tiles, one CTA per tile, `sms` CTAs per wave;
    the last wave is partly idle and edge tiles are partly padding, so the useful fraction is
    m*n / (waves * sms * tm * tn). Split-K: when the tiles are fewer than the SMs (a weight
    gradient: m*n small, k = tokens large), K is split s ways so tiles * s fill the waves (the
    partial sums' reduction is small against the main loop and not counted). The library is
    assumed to pick the best tile and split. Then k / (k + k_half) charges each tile's prologue and
    epilogue against its main loop."""
    best = 0.0
    for tm, tn in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for s in range(1, MAX_SPLIT_K + 1):
            if s > 1 and (tiles >= sms or k // s < 256):
                break
            waves = math.ceil(tiles * s / sms)
            eff = batch * m * n * s / (waves * sms * tm * tn)
            kk = k / s
            best = max(best, eff * kk / (kk + k_half) if k_half else eff)
    return best


def alignment_class(d: int, elems: int = 8) -> int | None:
    """None when d is a multiple of `elems` (8 bf16 elements: 16 bytes, what the fastest GEMM kernels
    load); else the largest power of two dividing d (1, 2 or 4)."""
    return None if d % elems == 0 else d & -d


def alignment_factor(prof: dict, m: int, n: int, k: int) -> float:
    """The measured slowdown of a bf16 GEMM whose m, n or k is not a multiple of 8 (1.0 when the
    profile measured none: a datasheet profile does not model it)."""
    table, f = prof.get("matmul_misaligned") or {}, 1.0
    for dim, d in (("m", m), ("n", n), ("k", k)):
        a = alignment_class(d)
        if a is not None:
            f *= table.get(str(a), {}).get(dim, 1.0)
    return f


def attention_wave_efficiency(batch: int, heads: int, seq: int, sms: int, block_q: int = 128) -> float:
    """Flash-style SDPA runs one CTA per (batch, head, 128-query block): wave quantization only."""
    tiles = batch * heads * math.ceil(seq / block_q)
    return tiles / (math.ceil(tiles / sms) * sms)


def causal_attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Forward FLOPs of causal SDPA, causal convention (ANCHORS.md): QKᵀ and PV, half the square."""
    return 2 * batch * heads * seq * seq * head_dim


def interconnect(name: str) -> dict | None:
    """Link figures (NVLink / IB per direction, collective latency) live in comm.py's GPU_PROFILES;
    this maps a timing profile name onto them (None where comm.py has no entry)."""
    from anatomy.calculator.comm import GPU_PROFILES

    key = get(name)["name"].removesuffix("-measured")
    key = {"a100-40gb-sxm": "a100-sxm", "a100-80gb-sxm": "a100-sxm"}.get(key, key)
    return GPU_PROFILES.get(key)
