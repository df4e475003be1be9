"""JSON reports -> the tables of docs/results.md and the README's summary, regenerated between markers, never hand-edited."""
from __future__ import annotations

import gzip
import io
import json
import math
import re
import zlib
from collections import defaultdict
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.config import ConfigError
from llm_anatomy.io import read_input, write_atomic  # noqa: F401  (the report package's one way to write a file)

MAX_CLAIMS_BYTES = 256 << 20  # a claims report of the whole suite is a few MB
MAX_README_BYTES = 16 << 20  # the README is ~100 kB


class ReportInputError(ValueError):
    """A claims file that cannot be read as one: its message is one line that names the file."""


_NUMBER = (int, float)
# key -> (accepted types, may be null); every claims row carries these (conftest.py's Claims.check/within)
_ROW_KEYS = {"claim": (str, False), "device": (str, False), "component": (str, False),
             "tolerance": (_NUMBER, False), "passed": (bool, False), "error": (_NUMBER, True),
             "predicted": (_NUMBER, True), "measured": (_NUMBER, True)}
_OPTIONAL_ROW_KEYS = {"test": str, "kind": str, "config": str, "variant": str, "unit": str, "note": str}


def _check_report(d, where: str) -> dict:
    """The claims report's shape, by type: a bad field is named with its row, never met later as a traceback."""
    if not isinstance(d, dict):
        raise ReportInputError(f"{where}: not a claims report (a JSON object with 'rows')")
    for key, types in (("rows", list), ("machine", dict), ("date", str)):
        if not isinstance(d.get(key), types):
            raise ReportInputError(f"{where}: '{key}' is missing or not a {types.__name__}")
    if d.get("command") is not None and not isinstance(d["command"], str):
        raise ReportInputError(f"{where}: 'command' is not a string")
    for i, r in enumerate(d["rows"]):
        if not isinstance(r, dict):
            raise ReportInputError(f"{where}: row {i} is not an object")
        for key, (types, nullable) in _ROW_KEYS.items():
            v = r.get(key)
            if v is None and nullable and key in r:
                continue
            # bool is an int subclass: a number field must not be a bool, a bool field must be one
            if key not in r or not isinstance(v, types) or (types is _NUMBER and isinstance(v, bool)):
                raise ReportInputError(f"{where}: row {i}: '{key}' is missing or has the wrong type")
            if types is _NUMBER and not math.isfinite(v):
                raise ReportInputError(f"{where}: row {i}: '{key}' is not a finite number")
        for key, types in _OPTIONAL_ROW_KEYS.items():
            if key in r and r[key] is not None and not isinstance(r[key], types):
                raise ReportInputError(f"{where}: row {i}: '{key}' is not a string")
    return d


def load(paths) -> list[dict]:
    """Claims reports, each checked by shape; ReportInputError (one line, naming the file) for any that is not."""
    out = []
    for p in paths:
        where = records.rel(Path(p))
        try:
            raw = read_input(p, "claims report", MAX_CLAIMS_BYTES)
            if Path(p).suffix == ".gz":  # the committed CPU report is gzipped JSON, held to the same bound unpacked
                with gzip.GzipFile(fileobj=io.BytesIO(raw)) as z:
                    raw = z.read(MAX_CLAIMS_BYTES + 1)
                if len(raw) > MAX_CLAIMS_BYTES:
                    raise ReportInputError(f"{where}: more than {MAX_CLAIMS_BYTES:,} bytes unpacked")
            d = json.loads(raw.decode("utf-8"))  # NaN/Infinity parse, then fail the finite check
        except ConfigError as e:  # not a regular file, or too large: the message names the file
            raise ReportInputError(str(e)) from None
        except (gzip.BadGzipFile, EOFError, zlib.error):
            raise ReportInputError(f"{where}: not a gzip file") from None
        except UnicodeDecodeError:
            raise ReportInputError(f"{where}: not UTF-8 text") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise ReportInputError(f"{where}: not valid JSON ({getattr(e, 'msg', 'nested too deep')})") from None
        except OSError as e:
            raise ReportInputError(f"{where}: cannot be read ({e.strerror or e})") from None
        out.append(_check_report(d, where))
    return out


def _is_range(r: dict) -> bool:
    """A range check (conftest's Claims.within): its error and tolerance are taken about the range's midpoint."""
    return r.get("kind") == "range"


def _tolerance(tols: list[float]) -> str:
    lo, hi = f"±{min(tols):.1%}", f"±{max(tols):.1%}"
    return "exact" if max(tols) == 0 else lo if lo == hi else f"{lo} to {hi}"


def claims_table(reports: list[dict]) -> str:
    """One row per (claim, device, kind of check: exact, within a tolerance, within a predicted range): the
    components covered, checks, passed, the worst error and the tolerance (a span where the checks carry their
    own). A range check's error about its midpoint says nothing a reader can use, so its row shows the range."""
    groups: dict[tuple, list] = defaultdict(list)
    for rep in reports:
        for r in rep["rows"]:
            groups[(r["claim"], r["device"], "range" if _is_range(r) else r["tolerance"] == 0)].append(r)
    lines = ["| claim | device | components | checks | passed | worst \\|error\\| | tolerance |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (claim, dev, kind), rows in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        errs = [abs(r["error"]) for r in rows if r["error"] is not None]  # None: no figure to compare (an OOM)
        worst = "–" if kind == "range" or not errs else f"{max(errs):.4%}"
        tol = "predicted range" if kind == "range" else _tolerance([r["tolerance"] for r in rows])
        comps = ", ".join(sorted({r["component"] for r in rows}))
        passed = sum(r["passed"] for r in rows)
        lines.append(f"| {claim} | {dev} | {comps} | {len(rows)} | {passed} | {worst} | {tol} |")
    srcs = sorted({f"{rep['machine'].get('gpu', 'CPU')}, torch {rep['machine'].get('torch')}, "
                   f"triton {rep['machine'].get('triton')}, CUDA {rep['machine'].get('cuda')}, {rep['date']}: "
                   f"`{records.command(rep.get('command'))}`" + _run_line(rep) for rep in reports})
    return "\n".join(lines + [""] + [f"- {s}" for s in srcs])


def _run_line(rep: dict) -> str:
    """The run's wall time and test outcome, where the report has them."""
    parts = [f"{rep['seconds']:.0f} s"] if rep.get("seconds") is not None else []
    parts += [f"{n} {k}" for k, n in (rep.get("outcome") or {}).items() if n]
    return f" ({', '.join(parts)})" if parts else ""


def read_readme(path) -> str:
    """The README to regenerate: a regular UTF-8 file of at most MAX_README_BYTES (ConfigError otherwise)."""
    try:
        return read_input(path, "README", MAX_README_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def replace_between(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    pat = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise ValueError(f"no {start} … {end} markers in the document")
    return pat.sub(lambda _: f"{start}\n{body}\n{end}", text)
