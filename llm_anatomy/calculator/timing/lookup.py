"""Finding a profile: by datasheet name or alias ("H200", "h200-sxm", case-insensitive), "<stem>-measured"
for the packaged llm_anatomy/calculator/profiles/<stem>.json, a path to a profile .json, or a mapping.
A profile file is read, validated (profile.check_measured) and fitted (fit.from_measured) once per version
of the file; every failure is a ConfigError of one line naming the file (and the field).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from llm_anatomy.calculator import gpus
from llm_anatomy.calculator.timing import derived
from llm_anatomy.calculator.timing.fit import from_measured
from llm_anatomy.calculator.timing.profile import Profile, check_measured, datasheet, from_dict
from llm_anatomy.config import ConfigError
from llm_anatomy.io import read_input

MAX_PROFILE_BYTES = 16 << 20  # a profile `anatomy calibrate` writes is ~120 kB
PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"  # the committed profiles the claims use


def user_profile_dir() -> Path:
    """Where `anatomy calibrate` writes by default: the user's cache, never the installed package."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "anatomy" / "profiles"


@lru_cache(maxsize=1)
def measured_files() -> dict[str, Path]:
    """{"<stem>-measured": path} of the packaged profiles, and {"<stem>-calibrated": path} of the ones
    `anatomy calibrate` wrote on this machine (listed once per process)."""
    out = {f"{f.stem}-measured": f for f in sorted(PROFILE_DIR.glob("*.json"))}
    out.update({f"{f.stem}-calibrated": f for f in sorted(user_profile_dir().glob("*.json"))})
    return out


def profile_stem(base: str) -> str:
    """The file stem a measured profile of a datasheet base is written under: h200-sxm -> h200."""
    return base.removesuffix("-sxm")


def measured_hint(base: str) -> str:
    """"; --gpu <stem>-measured ..." where the package holds a calibration of this datasheet part, else ""."""
    name = f"{profile_stem(base)}-measured"
    return f"; --gpu {name} times this project's calibration of one such GPU" if name in measured_files() else ""


def names() -> list[str]:
    return [*gpus.GPUS, *measured_files(), *(f"{k}-{kind}" for k in gpus.GPUS for kind in ("derived", "datasheet"))]


# "<gpu>-datasheet": the datasheet roofline; "<gpu>-derived[-low|-high]": the derived profile (derived.py)
_SUFFIXES = (("-derived-low", "low"), ("-derived-high", "high"), ("-derived", "point"), ("-datasheet", None))


def by_table_name(s: str) -> Profile | None:
    """The profile a GPU table name stands for, or None: a plain name times with its derived profile where
    one exists (every part but the measured base's own, derived.has_derived), else its datasheet; the
    suffixes name either one, or a derived bound."""
    low = s.lower().replace("_", "-")
    for suffix, bound in _SUFFIXES:
        if low.endswith(suffix) and (k := gpus.key(low.removesuffix(suffix))) is not None:
            return datasheet(k) if bound is None else derived.derive(k, bound, get(derived.BASE))
    k = gpus.key(s)
    if k is None:
        return None
    return derived.derive(k, "point", get(derived.BASE)) if derived.has_derived(k) else datasheet(k)


def bound_names(gpu) -> dict | None:
    """{"low": name, "high": name} of the bounds of the derived profile a --gpu value stands for, or None
    where it is not a derived profile (a measured or datasheet profile has no range)."""
    prof = get(gpu)
    if prof.kind != "derived":
        return None
    point = prof.name.removesuffix("-low").removesuffix("-high")
    return {b: f"{point}-{b}" for b in ("low", "high")}


def range_source(gpu) -> str:
    """What the range of a derived profile spans, in one sentence (its bounds' stated sources)."""
    return "; ".join(f"{b}: {get(n).sources['range']}" for b, n in (bound_names(gpu) or {}).items())


def get(gpu: str | Path | Mapping) -> Profile:
    """The profile a name, path or mapping stands for; a ConfigError of one line for anything else."""
    if isinstance(gpu, Profile):
        return gpu
    if isinstance(gpu, Mapping):
        if "measurements" in gpu:
            return from_measured(check_measured(dict(gpu), "gpu profile"))
        return from_dict(gpu)
    s = str(gpu).strip()
    if not s:
        raise ConfigError("empty gpu profile: give a name or a profile .json path")
    if s.endswith(".json"):
        return load(s)
    if (prof := by_table_name(s)) is not None:
        return prof
    low = s.lower().replace("_", "-").replace(":measured", "-measured")
    files = measured_files()
    for kind in ("measured", "calibrated"):
        if low.endswith(f"-{kind}") and f"{profile_stem(low.removesuffix(f'-{kind}'))}-{kind}" in files:
            return load(files[f"{profile_stem(low.removesuffix(f'-{kind}'))}-{kind}"])
    raise gpus.unknown(s, names())


_LOADED: dict[tuple, Profile] = {}  # (path, mtime, size) -> Profile: a file is parsed and fitted once


def load(path: str | Path) -> Profile:
    """A measured profile file, validated (check_measured) and built (fit.from_measured); cached per file
    version, so a sweep of estimates reads and fits it once."""
    key = None
    try:  # one stat: no path resolution, no Path object, per call
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
        if key in _LOADED:
            return _LOADED[key]
    except (OSError, TypeError, ValueError):
        pass  # the same error, said by read_input
    p = Path(path)
    raw = read_input(p, "gpu profile", MAX_PROFILE_BYTES)  # a regular file, or one line saying what it is
    try:
        data = json.loads(raw.decode("utf-8"))  # NaN and Infinity parse, and check_measured names their field
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply to be a gpu profile") from None
    try:
        prof = from_measured(check_measured(data, str(p)))
    except RecursionError:
        raise ConfigError(f"{p}: nested too deeply to be a gpu profile") from None
    if key is not None:
        _LOADED[key] = prof
    return prof
