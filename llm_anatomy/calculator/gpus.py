"""The one table of GPUs: datasheet figures, each with its source, and the links between GPUs.

Pure data and lookup, no torch, no imports from the calculator: the timing model builds its datasheet
profiles from this table (llm_anatomy.calculator.timing.profile), the communication model reads its links
(calculator/comm.py), `anatomy calibrate` names a device's base from it, and `anatomy train` reads its
peaks for MFU. Each entry:

  name, display          "h200-sxm", "NVIDIA H200 SXM"
  sms                    streaming multiprocessors (the unit of wave quantization)
  bf16_tflops            dense tensor-core bf16 with fp32 accumulate (no 2:4 sparsity), TFLOP/s
  fp32_tflops            plain fp32 on CUDA cores (torch keeps TF32 off for matmuls by default), TFLOP/s
  hbm_GBps               memory bandwidth, GB/s (1e9 B/s)
  memory_GB              memory capacity as the datasheet states it, GB (1e9 B); not what a process can allocate:
                         capacity_bytes() is (what torch.cuda.mem_get_info reports free on an idle device)
  pcie_GBps              effective per-direction bandwidth of the GPU's PCIe link (the ring's link on parts without
                         NVLink), GB/s; pcie_source says where it comes from
  nvlink_GBps, ib_GBps   per-direction bandwidth per GPU of NVLink and of its own inter-node NIC, GB/s
                         (None where the part has no such link figure here)
  alpha_intra_us, alpha_inter_us   per-collective latency inside a node / across nodes, microseconds: an
                         assumption (NCCL-tests' small-message times), not a measurement
  source, sms_source, link_source  where each figure comes from
"""
from __future__ import annotations

import difflib

from llm_anatomy.config import ConfigError, oneline

# ---- sources (one per figure set) --------------------------------------------------------------
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
B200_DS = ("NVIDIA Blackwell datasheet, https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703 (the source "
            "torchtitan's peak-FLOPs table cites), and the HGX B200 specifications, https://www.nvidia.com/en-us/"
            "data-center/hgx/: per GPU FP16/BF16 Tensor Core 4.5 PFLOPS with sparsity (2.25 dense), FP32 75 "
            "TFLOPS (600 for eight), HBM3e 8 TB/s, 180 GB (1,440 GB for eight)")
B200_SMS = ("Chips and Cheese, \"Nvidia's B200: Keeping the CUDA Juggernaut Rolling\", https://chipsandcheese.com/p/"
            "nvidias-b200-keeping-the-cuda-juggernaut: 74 SMs enabled on each of two dies, 148 SMs")
L4_DS = ("NVIDIA L4 product page / datasheet, https://www.nvidia.com/en-us/data-center/l4/: BF16 Tensor Core "
         "242 TFLOPS with sparsity (121 dense), FP32 30.3 TFLOPS, 300 GB/s, 24 GB; 58 SMs (7,424 CUDA cores / 128)")

# Links (calculator/comm.py). NVLink: H100/H200 SXM have NVLink 4, "900 GB/s" total (18 links x 50 GB/s, both
# directions): 450 GB/s each way (H100 and H200 datasheets); A100 SXM NVLink 3: 600 GB/s total, 300 each way
# (A100 datasheet). IB: DGX H100/H200 give every GPU its own ConnectX-7 NIC at 400 Gb/s = 50 GB/s (DGX H100/H200
# user guide, "8x single-port ConnectX-7 400Gb/s InfiniBand"); DGX A100: 8x ConnectX-6 HDR 200 Gb/s = 25 GB/s.
NVLINK4_DGX = ("NVIDIA H100/H200 datasheets (NVLink 4, 900 GB/s total, 450 each way); DGX H100/H200 user guide "
               "(one 400 Gb/s ConnectX-7 per GPU: 50 GB/s)")
NVLINK5_DGX = ("NVIDIA HGX B200 specifications (NVLink 5, 1.8 TB/s total per GPU, 900 each way); DGX B200 user guide "
               "(one 400 Gb/s ConnectX-7 per GPU: 50 GB/s)")
NVLINK3_DGX = "NVIDIA A100 datasheet (NVLink 3, 600 GB/s total, 300 each way); DGX A100 (one 200 Gb/s HDR per GPU)"
ALPHA_INTRA_US, ALPHA_INTER_US = 10.0, 25.0  # assumption: NCCL-tests' small-message times, inside / across nodes
# PCIe: x16 signalling is 32 GB/s per direction at Gen4 and 64 GB/s at Gen5 (PCI-SIG; the datasheets' "64 GB/s" and
# "128 GB/s" are both directions together); what a copy or a ring reaches is ~80% of it (TLP headers, flow control):
# 25 and 50 GB/s, an assumption in the range NCCL-tests report for PCIe-only servers, not a measurement of ours.
PCIE4 = ("PCIe Gen4 x16: 32 GB/s per direction (PCI-SIG; datasheet '64 GB/s' bidirectional); ~25 GB/s effective, an "
         "assumption (~80% of the link after protocol overhead)")
PCIE5 = ("PCIe Gen5 x16: 64 GB/s per direction (PCI-SIG; H100 datasheet '128 GB/s' bidirectional); ~50 GB/s effective, "
         "an assumption (~80% of the link after protocol overhead)")
# Inter-node for servers without a DGX reference design: one 200 Gb/s NIC per GPU (25 GB/s), as in a DGX A100;
# an assumption, named as one wherever it is used.
NIC_ASSUMED = "assumption: one 200 Gb/s NIC per GPU (25 GB/s), as a DGX A100; no reference design for this part"


def _gpu(name, display, sms, bf16_tflops, fp32_tflops, hbm_GBps, memory_GB, source, sms_source=None,
         nvlink_GBps=None, ib_GBps=None, link_source=None, pcie=PCIE4) -> dict:
    return dict(name=name, display=display, sms=sms, bf16_tflops=bf16_tflops, fp32_tflops=fp32_tflops,
                hbm_GBps=hbm_GBps, memory_GB=memory_GB, source=source, sms_source=sms_source or source,
                nvlink_GBps=nvlink_GBps, ib_GBps=ib_GBps, link_source=link_source,
                pcie_GBps=25.0 if pcie is PCIE4 else 50.0, pcie_source=pcie,
                alpha_intra_us=ALPHA_INTRA_US, alpha_inter_us=ALPHA_INTER_US)


GPUS: dict[str, dict] = {g["name"]: g for g in (
    _gpu("a100-40gb-sxm", "NVIDIA A100 SXM 40GB", 108, 312.0, 19.5, 1555.0, 40, A100_DS, A100_WP, 300.0, 25.0,
         NVLINK3_DGX),
    _gpu("a100-80gb-sxm", "NVIDIA A100 SXM 80GB", 108, 312.0, 19.5, 2039.0, 80, A100_DS, A100_WP, 300.0, 25.0,
         NVLINK3_DGX),
    _gpu("h100-sxm", "NVIDIA H100 SXM", 132, 989.4, 66.9, 3350.0, 80, H100_DS, HOPPER_WP, 450.0, 50.0, NVLINK4_DGX,
         pcie=PCIE5),
    _gpu("h100-pcie", "NVIDIA H100 PCIe", 114, 756.5, 51.2, 2000.0, 80, H100_PCIE_DS, pcie=PCIE5),
    _gpu("h200-sxm", "NVIDIA H200 SXM", 132, 989.4, 66.9, 4800.0, 141, H200_DS, HOPPER_WP, 450.0, 50.0, NVLINK4_DGX,
         pcie=PCIE5),
    _gpu("b200", "NVIDIA B200", 148, 2250.0, 75.0, 8000.0, 180, B200_DS, B200_SMS, 900.0, 50.0, NVLINK5_DGX,
         pcie=PCIE5),
    _gpu("l40s", "NVIDIA L40S", 142, 362.05, 91.6, 864.0, 48, L40S_DS),
    _gpu("l4", "NVIDIA L4", 58, 121.0, 30.3, 300.0, 24, L4_DS),
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090", 82, 71.0, 35.6, 936.0, 24, GA102_WP),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", 128, 165.2, 82.6, 1008.0, 24, ADA_WP),
)}

# Names as users type them, matched after fold() (case, spaces, '-' and '_' ignored): each table key and each
# display name, and these. torch.cuda.get_device_name()'s strings are among them.
ALIASES = {
    "a100-80gb": "a100-80gb-sxm", "a100-sxm4-80gb": "a100-80gb-sxm", "nvidia a100-sxm4-80gb": "a100-80gb-sxm",
    "a100-40gb": "a100-40gb-sxm", "a100-sxm4-40gb": "a100-40gb-sxm", "nvidia a100-sxm4-40gb": "a100-40gb-sxm",
    "h100-sxm5": "h100-sxm", "h100-sxm-80gb": "h100-sxm", "nvidia h100 80gb hbm3": "h100-sxm",
    "h100-pcie-80gb": "h100-pcie", "nvidia h100 pcie": "h100-pcie",
    "h200": "h200-sxm", "nvidia h200": "h200-sxm", "h200-141gb": "h200-sxm",
    "b200-180gb": "b200", "l40s-48gb": "l40s", "l4-24gb": "l4",
    "3090": "rtx-3090", "geforce rtx 3090": "rtx-3090", "4090": "rtx-4090", "geforce rtx 4090": "rtx-4090",
}
# Names that fit more than one part. Refused, listing the parts, where the parts differ in memory (what a plan
# fits into); otherwise resolved by the stated rule, which the commands print.
AMBIGUOUS = {name: ("a100-40gb-sxm", "a100-80gb-sxm") for name in ("a100", "a100-sxm", "a100-sxm4", "nvidia a100")}
RULES = {name: ("h100-sxm", "H100 without SXM or PCIe means the SXM part (132 SMs, NVLink 4); --gpu h100-pcie names "
                            "the PCIe card, 80 GB as well")
         for name in ("h100", "h100-80gb", "nvidia h100")}

# torch.cuda.get_device_name() substring (lower case) -> entry; the first match wins
_DEVICE_NAMES = (("h200", "h200-sxm"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("b200", "b200"),
                 ("a100-sxm4-40gb", "a100-40gb-sxm"), ("a100", "a100-80gb-sxm"), ("l40s", "l40s"), ("l4", "l4"),
                 ("rtx 3090", "rtx-3090"), ("rtx 4090", "rtx-4090"))


def fold(name) -> str:
    """A name as it is matched: lower case, with spaces, '-' and '_' left out ("H100 SXM" is "h100-sxm")."""
    return "".join(c for c in str(name).lower() if not (c.isspace() or c in "-_"))


def _names() -> dict[str, str]:
    """fold(name) -> table key, for every key, display name and alias."""
    out = {fold(d): k for k, g in GPUS.items() for d in (k, g["display"])}
    out.update({fold(a): k for a, k in ALIASES.items()})
    out.update({fold(a): k for a, (k, _) in RULES.items()})
    return out


NAMES = _names()
_AMBIGUOUS = {fold(a): parts for a, parts in AMBIGUOUS.items()}
_RULES = {fold(a): rule for a, (_, rule) in RULES.items()}


def key(name: str) -> str | None:
    """The table's key for a name as a user types it (fold(): case, spaces, '-' and '_' ignored; aliases), or
    None. A name that fits parts of different memory (A100: 40 or 80 GB) is a one-line ConfigError listing them."""
    f = fold(name)
    if f in _AMBIGUOUS:
        raise ConfigError(f"gpu {oneline(repr(str(name)), 60)} is ambiguous: it names "
                          f"{' or '.join(_AMBIGUOUS[f])} (memory differs); give one of them")
    return NAMES.get(f)


def rule(name: str) -> str | None:
    """The stated rule by which an ambiguous name was resolved ("H100": the SXM part), or None."""
    return _RULES.get(fold(name))


def unknown(name: str, choices=()) -> ConfigError:
    """The one-line error for a name that is no GPU here: the closest names (difflib), else the table's keys."""
    pool = {fold(c): c for c in (*ALIASES, *RULES, *GPUS, *choices)}
    close = [pool[m] for m in difflib.get_close_matches(fold(name), pool, n=4, cutoff=0.5)]
    hint = f"closest: {', '.join(dict.fromkeys(close))}" if close else f"choose from {', '.join(GPUS)}"
    return ConfigError(f"unknown gpu {oneline(repr(str(name)), 60)}; {hint} (anatomy plan -h lists every name; or "
                       "a profile .json path)")


def entry(name: str) -> dict:
    """The table's entry (a copy) for a name, or a one-line ConfigError."""
    k = key(name)
    if k is None:
        raise unknown(name)
    return dict(GPUS[k])


def for_device_name(device_name: str) -> dict | None:
    """The entry of a CUDA device by its reported name (torch.cuda.get_device_name), or None if it is not in
    the table. peak_flops[dtype] (FLOP/s) is added for `anatomy train`'s MFU."""
    low = device_name.lower()
    for sub, k in _DEVICE_NAMES:
        if sub in low:
            e = dict(GPUS[k])
            e["peak_flops"] = {"bfloat16": e["bf16_tflops"] * 1e12, "float32": e["fp32_tflops"] * 1e12}
            return e
    return None


def base_for_device(device_name: str) -> str | None:
    """The entry key a device's calibrated profile builds on (None if no entry matches)."""
    e = for_device_name(device_name)
    return None if e is None else e["name"]


# ---- true capacity: what a process can allocate ----------------------------------------------------------
# torch.cuda.mem_get_info() on an idle device: (free, total). `total` is the driver's figure after its own
# reservations (less than nvidia-smi's "Total"); `free` is total minus this process's CUDA context. A run
# fits when its predicted max_memory_allocated is at most `free` (reserved-but-unallocated memory aside).
GiB = 2**30
CONTEXT_GiB = 139.80 - 139.29  # the CUDA context: total - free on a fresh H200 (measured, below)
H200_MEASURED = ("measured: torch.cuda.mem_get_info() on a fresh H200 SXM (torch 2.11, CUDA 13): 139.29 GiB free of "
                 "139.80 GiB total")
# `total` as torch prints it ("GPU 0 has a total capacity of X GiB" / "X GiB total capacity" in its OOM
# message: the same mem_get_info figure), as users published it; where drivers differ, the lowest.
_TOTAL_PUBLISHED = {
    "h100-sxm": (79.11, "torch OOM message on an H100 80GB HBM3, 'total capacity of 79.11 GiB' "
                        "(github.com/vllm-project/vllm/issues/27508)"),
    "a100-80gb-sxm": (79.25, "torch OOM messages on A100 80GB, 'total capacity of 79.25 GiB' (github.com/levihsu/"
                             "OOTDiffusion/issues/235, github.com/wbfwonderful/Vad-R1/issues/11; 79.33-79.35 elsewhere)"),
    "a100-40gb-sxm": (39.50, "torch OOM message on an A100 40GB, 'total capacity of 39.50 GiB' "
                             "(github.com/TianheWu/CoSeR/issues/10)"),
    "l40s": (44.42, "torch OOM message on an L40S, 'total capacity of 44.42 GiB' "
                    "(github.com/stepfun-ai/Step-Video-T2V/issues/8)"),
    "rtx-3090": (23.70, "torch OOM messages on RTX 3090, '23.70 GiB total capacity' (github.com/GaoLii/DSP/issues/10, "
                        "github.com/xiaoxiangAQ/GAS-Net/issues/7)"),
    "rtx-4090": (23.61, "torch OOM message on an RTX 4090, 'total capacity of 23.61 GiB' (github.com/pinokiofactory/"
                        "flux-webui/issues/11; 23.64-23.68 elsewhere)"),
}
# Where no torch total is published: nvidia-smi's "Total" (MiB) less the driver's reservation, taken from the
# H100 pair (nvidia-smi 81,559 MiB = 79.65 GiB, github.com/huggingface/text-generation-inference/issues/2572,
# against torch's 79.11 GiB): 0.54 GiB.
DRIVER_RESERVED_GiB = 81_559 / 1024 - 79.11
_NVIDIA_SMI_MIB = {
    "h100-pcie": (81_559, "nvidia-smi 'Total' assumed the H100 SXM's 81,559 MiB (both 80 GB HBM parts)"),
    "l4": (23_034, "nvidia-smi 'Total' 23,034 MiB as commonly reported for the L4 (no source stored here)"),
    "b200": (183_359, "nvidia-smi 'Total' 183,359 MiB as commonly reported for the B200 (no source stored here)"),
}


def base_key(name: str) -> str | None:
    """The table's key for a name, an alias or a profile name ("h200-measured", "h200-calibrated": the
    datasheet part it was measured on; "h100-derived[-low|-high]", "h100-datasheet": that part), or None."""
    low = fold(name)
    for suffix in ("low", "high", "derived", "datasheet", "measured", "calibrated"):
        if suffix in ("low", "high") and not low.endswith("derived" + suffix):
            continue
        low = low.removesuffix(suffix)
    return key(low)


def capacity_bytes(name: str) -> tuple[int, str]:
    """(bytes a training process can allocate on an idle GPU, where that figure comes from), for a table name,
    an alias, or a profile name ("h200-measured", "h200-calibrated": its datasheet base). It is
    torch.cuda.mem_get_info()'s free figure: measured on the H200; elsewhere derived, and the source says how."""
    k = base_key(name)
    if k is None:
        raise unknown(name)
    ctx = f"less the CUDA context, {CONTEXT_GiB:.2f} GiB (total - free on the H200, measured)"
    if k == "h200-sxm":
        return int(139.29 * GiB), H200_MEASURED
    if k in _TOTAL_PUBLISHED:
        total, src = _TOTAL_PUBLISHED[k]
        return int((total - CONTEXT_GiB) * GiB), f"derived: torch's total {total:.2f} GiB ({src}) {ctx}"
    mib, src = _NVIDIA_SMI_MIB[k]
    gib = mib / 1024 - DRIVER_RESERVED_GiB - CONTEXT_GiB
    return int(gib * GiB), (f"derived: {src} = {mib / 1024:.2f} GiB, less the driver's reservation "
                            f"{DRIVER_RESERVED_GiB:.2f} GiB (the H100's nvidia-smi total - torch's total) {ctx}")
