"""The GPU suite's calibration, measured once per machine and kept on disk.

The session fixture `gpu_profile` (conftest.py) calls `cached_profile`: the profile that `anatomy calibrate`
measures on this GPU, cached as JSON (never pickle) under a file named by what the figures depend on: the
GPU's name, the driver, and the CUDA, torch and triton versions. Any change in one of them is a new file and
a new calibration; a file whose recorded key differs from its name's facts, or that does not parse, is
measured again and replaced. Everything that touches the GPU is injected, so the CPU tests drive the keying
and caching with a fake calibration (validations/test_profile_cache.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

KEY = ("gpu", "driver", "cuda", "torch", "triton")  # what a calibration's figures depend on
ENV = "ANATOMY_GPU_PROFILE_CACHE"  # the cache folder; default DEFAULT_DIR
DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".anatomy" / "gpu-profiles"  # git-ignored


def machine_key() -> dict:
    """This machine's KEY facts (CUDA): device 0's name, the driver (nvidia-smi), CUDA, torch and triton."""
    import torch
    import triton

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip().splitlines()
    return dict(gpu=torch.cuda.get_device_name(0), driver=driver[0] if driver else None, cuda=torch.version.cuda,
                torch=torch.__version__, triton=triton.__version__)


def file_name(key: dict) -> str:
    """The cache file of a key: each fact in KEY order, characters other than [A-Za-z0-9.+] as '-'.
    A missing fact is a ValueError: a profile keyed without it could be read on a machine it does not fit."""
    missing = [k for k in KEY if not key.get(k)]
    if missing:
        raise ValueError(f"profile cache: no {', '.join(missing)} for this machine")
    return "_".join(re.sub(r"[^A-Za-z0-9.+]+", "-", str(key[k])).strip("-") for k in KEY) + ".json"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


def _read(path: Path, key: dict) -> dict | None:
    """The cached profile, or None when the file is missing, does not parse, or was keyed differently."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != {k: key[k] for k in KEY} or not isinstance(doc.get("profile"), dict):
        return None
    return doc["profile"]


def cached_profile(key: dict, calibrate: Callable[[Path], int], folder: Path | None = None) -> tuple[dict, Path, bool]:
    """(profile, its cache file, whether it was measured now). `calibrate(path)` measures and writes the
    profile JSON to `path`, returning 0 (llm_anatomy.measure.calibrate.main(["--out", path]) does); it runs only
    when the cache has no valid file for `key`. A failed calibration writes nothing and raises RuntimeError."""
    folder = Path(folder or cache_dir())
    path = folder / file_name(key)
    hit = _read(path, key)
    if hit is not None:
        return hit, path, False
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / "profile.json"
        rc = calibrate(out)
        try:
            profile = json.loads(out.read_text())
        except (OSError, ValueError):
            profile = None
        if rc != 0 or not isinstance(profile, dict):
            raise RuntimeError(f"profile cache: the calibration failed (exit {rc}); nothing cached")
        staged = Path(tmp) / path.name
        staged.write_text(json.dumps(dict(key={k: key[k] for k in KEY}, profile=profile), indent=1) + "\n")
        os.replace(staged, path)  # atomic: a parallel session reads the old file or the new one
    return profile, path, True


def calibrate_with_anatomy(out: Path) -> int:
    """The real calibration: `anatomy calibrate --out OUT` in a process of its own. Its profiler steps leave
    CUPTI attached to the process that ran them, which would slow the suite's host-bound timings after it."""
    import sys

    return subprocess.run([sys.executable, "-m", "llm_anatomy.cli", "calibrate", "--out", str(out)]).returncode
