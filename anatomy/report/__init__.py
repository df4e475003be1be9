"""JSON reports -> README tables. The README's result sections are regenerated between markers, never hand-edited."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path


def load(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def claims_table(reports: list[dict]) -> str:
    """One row per (claim, device): components covered, checks, passed, worst error, tolerance."""
    groups: dict[tuple, list] = defaultdict(list)
    for rep in reports:
        for r in rep["rows"]:
            groups[(r["claim"], r["device"], r["tolerance"])].append(r)
    lines = ["| claim | device | components | checks | passed | worst \\|error\\| | tolerance |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (claim, dev, tol), rows in sorted(groups.items()):
        errs = [abs(r["error"]) for r in rows if r["error"] is not None]  # None: no figure to compare (an OOM)
        worst = f"{max(errs):.4%}" if errs else "–"
        comps = ", ".join(sorted({r["component"] for r in rows}))
        lines.append(f"| {claim} | {dev} | {comps} | {len(rows)} | {sum(r['passed'] for r in rows)} | "
                     f"{worst} | {'exact' if tol == 0 else f'±{tol:.1%}'} |")
    srcs = sorted({f"{rep['machine'].get('gpu', 'CPU')}, torch {rep['machine'].get('torch')}, "
                   f"triton {rep['machine'].get('triton')}, CUDA {rep['machine'].get('cuda')}, {rep['date']}: "
                   f"`{rep['command']}`" for rep in reports})
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
