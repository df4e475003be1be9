"""Published SM clocks and board power of the datasheet GPUs: the sustained-load term of a datasheet profile.

A GPU runs short bursts at its boost clock; a long, heavy step draws more than the board's power limit at
that clock, and the power controller lowers the SM clock until it fits. The clock NVIDIA guarantees under
a heavy load at the board power (TDP) is the base clock, so a datasheet profile takes

    sustained compute rate = burst rate x base_MHz / boost_MHz

for compute-bound kernels (GEMMs, attention), and leaves the memory-bound ones at the burst bandwidth (HBM
runs on its own clock). The base clock is a lower bound of the sustained one (a GPU under its power limit
holds more), so a datasheet sustained estimate is pessimistic where the burst one is optimistic: most
for the low-power parts whose base clock is far under their boost (L4, L40S: 0.39, 0.44).

Pure data, no imports from the calculator (it sits beside gpus.py). Each entry:
    name: (boost_MHz, base_MHz, tdp_W, source)
"""
from __future__ import annotations

TPU = "TechPowerUp GPU Database (https://www.techpowerup.com/gpu-specs/), "

CLOCKS: dict[str, tuple[int, int, int, str]] = {
    "a100-40gb-sxm": (1410, 1095, 400, TPU + "A100 SXM4 40 GB (gpu-specs/a100-sxm4-40-gb.c3506): base 1095 MHz, "
                      "boost 1410 MHz, 400 W"),
    "a100-80gb-sxm": (1410, 1275, 400, TPU + "A100 SXM4 80 GB: base 1275 MHz, boost 1410 MHz, 400 W"),
    "h100-sxm": (1980, 1590, 700, TPU + "H100 SXM5 80 GB: base 1590 MHz, boost 1980 MHz, 700 W; NVIDIA H100 "
                 "datasheet: max TDP up to 700 W (SXM)"),
    "h100-pcie": (1755, 1125, 350, TPU + "H100 PCIe 80 GB: base 1125 MHz, boost 1755 MHz; NVIDIA H100 PCIe "
                  "product brief PB-11133-001: 350 W max TDP"),
    "h200-sxm": (1980, 1590, 700, TPU + "H200 SXM 141 GB: base 1590 MHz, boost 1980 MHz, 700 W (the H100 "
                 "SXM's GH100 die and clocks); NVIDIA H200 datasheet: max TDP up to 700 W"),
    "b200": (1837, 1665, 1000, TPU + "B200 SXM 192 GB: base 1665 MHz, boost 1837 MHz, 1000 W; NVIDIA HGX B200 "
             "specifications: up to 1,000 W per GPU"),
    "l40s": (2520, 1110, 350, TPU + "L40S: base 1110 MHz, boost 2520 MHz, 350 W"),
    "l4": (2040, 795, 72, TPU + "L4: base 795 MHz, boost 2040 MHz, 72 W"),
    "rtx-3090": (1695, 1395, 350, TPU + "GeForce RTX 3090: base 1395 MHz, boost 1695 MHz, 350 W"),
    "rtx-4090": (2520, 2235, 450, TPU + "GeForce RTX 4090: base 2235 MHz, boost 2520 MHz, 450 W"),
}

# The time constant of the fall from the boost to the power-limited clock under a heavy load: not on any
# datasheet. A measured profile replaces it (calibrate_sustained:measure_sustained); this is an assumption.
ASSUMED_TAU_S = 0.5
ASSUMED_TAU = ("assumption, not a measurement: the SM clock falls from boost to its power-limited value with a "
               "time constant of ~0.5 s under a heavy load; calibrate_sustained:measure_sustained measures it")
MEMORY_RATIO_SOURCE = "assumption: HBM runs on its own clock; a memory-bound kernel keeps its burst bandwidth"


def clock(name: str) -> tuple[int, int, int, str] | None:
    """(boost_MHz, base_MHz, tdp_W, source) of a GPU table entry, or None where there is none."""
    return CLOCKS.get(name)


def sustained_ratio(name: str) -> dict | None:
    """{"matmul", "attention", "memory": sustained rate / burst rate} from the published clocks, or None."""
    c = CLOCKS.get(name)
    if c is None:
        return None
    r = c[1] / c[0]
    return dict(matmul=r, attention=r, memory=1.0)
