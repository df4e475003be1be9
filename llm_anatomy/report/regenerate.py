"""`anatomy report` with no claims files: rebuild every generated section of a checkout from its committed JSON.

The record tables live in docs/results.md; the README carries the plan example and one summary table. Each
section sits between <!-- name:start --> and <!-- name:end --> markers, in whichever of the two documents
holds them; the text between is replaced, never edited by hand. Images go to docs/img/, the claim index to
docs/claims.md. Everything is read from, and written into, the checkout `root`, never the package's folder.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from llm_anatomy import records
from llm_anatomy.io import write_atomic
from llm_anatomy.report import claims_table, load, read_readme, replace_between
from llm_anatomy.report.summary import summary_table

README = Path("README.md")
RESULTS = Path("docs/results.md")
IMG = Path("docs/img")
CLAIMS_DOC = Path("docs/claims.md")
# the step tables of docs/results.md: marker -> the records.STEPS run whose step-*.json records it shows
STEP_TABLES = {"bench-steps": "peers", "bench-steps-rerun": "baseline-peers", "bench-steps-recompute": "recompute"}
MOE_STEPS = "moe-peers"  # the run the MoE peers table reads (report/steps.py moe_peers_table)
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def from_docs(body: str) -> str:
    """Repo-relative links of a generated body as written from docs/: docs/x becomes x, anything else ../x."""
    def fix(m):
        target = m.group(2)
        if re.match(r"^(https?:|#|mailto:|\.\./)", target):
            return m.group(0)
        return f"[{m.group(1)}]({target[5:] if target.startswith('docs/') else '../' + target})"

    return _LINK.sub(fix, body)


def regenerate(root: Path | str = ".") -> list[str]:
    """Rebuild the generated sections of the checkout at `root` (records.NotACheckout where it is none); the
    markers rebuilt, in order.

    All or nothing: the claims reports are checked first (ReportInputError names a malformed one), and every
    output is rendered to memory or a private temporary folder before the first file is written; then each
    changed file is written with llm_anatomy.io.write_atomic. Nothing written carries an absolute path."""
    with records.at(root) as root:
        return _regenerate(root)


def _regenerate(root: Path) -> list[str]:
    claim_paths = [p for p in (records.CPU_CLAIMS,) if p.exists()] + records.gpu_claims()
    claim_reports = load(claim_paths)  # before anything is rendered: a malformed file stops the run here
    docs = {doc: read_readme(root / doc) for doc in (README, RESULTS)}
    done, files = [], {}

    def put(marker, body):
        doc = next((d for d, text in docs.items() if f"<!-- {marker}:start -->" in text), RESULTS)
        docs[doc] = replace_between(docs[doc], marker, from_docs(body) if doc == RESULTS else body)
        done.append(marker)

    with tempfile.TemporaryDirectory(prefix="anatomy-report-") as stage:
        stage = Path(stage)

        def image(name: str, draw) -> str:
            """Draw into the private folder, keep the bytes for the commit; the link, repo-relative."""
            draw(stage / name)
            files[root / IMG / name] = (stage / name).read_bytes()
            return (IMG / name).as_posix()

        _claims(put, image, files, root, claim_paths, claim_reports)
        _records(put, image, files, root)
    for doc, text in docs.items():
        files[root / doc] = text
    commit(files)
    return done


def _claims(put, image, files, root, claim_paths, claim_reports) -> None:
    cpu = [r for p, r in zip(claim_paths, claim_reports) if p == records.CPU_CLAIMS]
    gpu = [r for p, r in zip(claim_paths, claim_reports) if p != records.CPU_CLAIMS]
    if cpu:
        put("claims-cpu", claims_table(cpu))
    if gpu:
        put("claims-h200", claims_table(gpu))
    if not claim_reports:
        return
    from llm_anatomy.report import claims_doc
    from llm_anatomy.report.plots import error_distribution, predicted_vs_measured

    put("results-summary", summary_table(cpu, gpu))
    pvm = image("claims-predicted-vs-measured.png", lambda p: predicted_vs_measured(claim_reports, p))
    err = image("claims-error-distribution.png", lambda p: error_distribution(claim_reports, p))
    srcs = ", ".join(f"`{records.rel(p)}`" for p in claim_paths)
    put("claims-plots", f"From {srcs}. Rows whose device reads `cuda (recorded)` or `cuda` in the CPU report "
        "compare against committed H200 measurements. Each claim's formula, code, tests and data: "
        f"[{CLAIMS_DOC.as_posix()}]({CLAIMS_DOC.as_posix()}).\n\n"
        f"![predicted against measured]({pvm})\n![error distribution of the bounded claims]({err})")
    files[root / CLAIMS_DOC] = claims_doc.render(list(zip(claim_paths, claim_reports)))


def _records(put, image, files, root) -> None:
    from llm_anatomy.report import gate, plan, probes, real_depth
    from llm_anatomy.report.readme import (
        curves_text,
        kernels_gpu_only_table,
        kernels_table,
        linear_ce_table,
        peers_power_table,
        peers_profile_table,
        profile_text,
        saved_plot,
        saved_table,
        steps_table,
    )

    for marker, run in STEP_TABLES.items():
        steps = records.step_records(run)
        if steps:
            put(marker, steps_table(steps, records.PEERS_ENV if run == "peers" else None))
    from llm_anatomy.report.steps import moe_peers_table

    put("bench-steps-moe", moe_peers_table(records.step_records(MOE_STEPS)))
    put("profile-peers", peers_profile_table(records.PEERS_PROFILES))
    put("power-peers", peers_power_table(records.PEERS_POWER, records.PEERS_POWER_ENV))
    if records.STEP_PROFILE.exists():
        put("profile-seed", profile_text(records.STEP_PROFILE, records.STEPS["profiled"] / "step-seed-efficient.json"))
    for marker, path, render in (("bench-kernels", records.KERNELS_BACK_TO_BACK, kernels_table),
                                 ("bench-kernels-gpu-only", records.KERNELS_GPU_ONLY, kernels_gpu_only_table),
                                 ("bench-linear-ce", records.LINEAR_CE, linear_ce_table),
                                 ("train-seed", records.LOSS_CURVES, curves_text)):
        if path.exists():
            put(marker, render(path))
    if records.GATE_CHECK.exists():
        put("gate-h200", gate.summary())
    put("plan-example", plan.example())
    put("plan-h200", plan.check_table() if records.PLAN_CHECK.exists() else
        f"No GPU record yet: `scripts/check_plan.py` writes `{records.rel(records.PLAN_CHECK)}` on an H200, and "
        "the claims above are unproven until it is committed.")
    put("memory-h200", probes.memory_summary())
    put("memory-recompute", probes.recompute_summary())
    put("timing-h200", probes.timing_summary())
    put("real-depth-h200", real_depth.summary())
    # the roof of the first real-depth run with its own calibration: its kernels on that roof
    roof_src = next((p.with_name("calibrated.json") for p in records.REAL_DEPTH_RUNS
                     if p.with_name("calibrated.json").exists()), records.H200_PROFILE)
    if roof_src.exists():
        from llm_anatomy.report import roofline, sdpa_plot

        roof = image("roofline-h200.png", lambda p: roofline.plot(roof_src, p))
        put("roofline-h200", roofline.summary(roof_src) + f"\n\n![measured roofline]({roof})")
        sdpa = image("sdpa-schedule-h200.png", sdpa_plot.plot)
        put("sdpa-h200", sdpa_plot.summary() + f"\n\n![cuDNN SDPA kernel, predicted over measured]({sdpa})")
    table, data = saved_table()
    files[root / IMG / "saved-by-component.png"] = saved_plot(data)
    put("saved-seed", table + f"\n\n![saved bytes per component]({(IMG / 'saved-by-component.png').as_posix()})")
    from llm_anatomy.distributed.report import memory_table

    put("distributed-memory", memory_table())


def commit(files: dict[Path, str | bytes]) -> None:
    """Write every rendered file that changed (write_atomic each); unchanged files are left untouched."""
    for path, data in files.items():
        raw = data.encode() if isinstance(data, str) else data
        if path.exists() and path.read_bytes() == raw:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, raw)
