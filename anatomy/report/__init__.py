"""JSON reports -> README tables. The README's result sections are regenerated between markers, never hand-edited."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from anatomy import records


def load(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


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
                   f"`{records.command(rep['command'])}`" for rep in reports})
    return "\n".join(lines + [""] + [f"- {s}" for s in srcs])


def replace_between(text: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    pat = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise ValueError(f"README has no {start} … {end} markers")
    return pat.sub(lambda _: f"{start}\n{body}\n{end}", text)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
