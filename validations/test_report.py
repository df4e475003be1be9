"""`anatomy report`: claims JSON -> docs/results.md tables, the README summary and plots, on a synthetic report
and on a copy of the checkout."""
import pytest

from llm_anatomy.report import claims_table, replace_between
from llm_anatomy.report.plots import error_distribution, family, predicted_vs_measured

PNG = b"\x89PNG\r\n\x1a\n"


def _report():
    row = dict(test="t", component="model", config="c", variant="baseline", unit="B", note="")
    rows = [dict(row, claim="memory.peak in backward", device="cpu", predicted=103, measured=100, error=0.03,
                 tolerance=0.03, passed=True),
            dict(row, claim="memory.peak in backward", device="cpu", predicted=90, measured=100, error=-0.10,
                 tolerance=0.03, passed=False),
            dict(row, claim="flops.counter.forward", device="cpu", predicted=5e9, measured=5e9, error=0.0,
                 tolerance=0.0, passed=True)]
    return dict(rows=rows, machine=dict(torch="2.13.0+cpu", triton="3.9.0", cuda=None), date="2026-11-29",
                command="pytest validations")


def test_claims_table_groups_and_reports_the_worst_error():
    table = claims_table([_report()])
    assert "| memory.peak in backward | cpu | model | 2 | 1 | 10.0000% | ±3.0% |" in table
    assert "| flops.counter.forward | cpu | model | 1 | 1 | 0.0000% | exact |" in table
    assert "CPU, torch 2.13.0+cpu, triton 3.9.0, CUDA None, 2026-11-29: `pytest validations`" in table


def test_claims_table_gives_one_row_per_claim_with_its_tolerances_as_a_range():
    """Checks of one claim that carry their own tolerances share one row, the tolerances as a span; an exact
    check of the same claim keeps its own row; range checks (Claims.within) show the range, not an error
    about its midpoint."""
    rep = _report()
    base = dict(rep["rows"][0], claim="memory.reserved")
    rep["rows"] += [dict(base, tolerance=t, error=e, passed=p) for t, e, p in ((0.169, 0.05, True),
                                                                               (0.27, 0.30, False),
                                                                               (0.20, 0.01, True))]
    rep["rows"].append(dict(rep["rows"][0], tolerance=0.0, error=0.0))
    rep["rows"] += [dict(base, claim="memory.range", tolerance=0.5, error=e, passed=e < 1, kind="range",
                         note="range [1, 3] B")
                    for e in (0.4, 9.0)]
    table = claims_table([rep])
    assert "| memory.range | cpu | model | 2 | 1 | – | predicted range |" in table
    assert "| memory.reserved | cpu | model | 3 | 2 | 30.0000% | ±16.9% to ±27.0% |" in table
    assert "| memory.peak in backward | cpu | model | 1 | 1 | 0.0000% | exact |" in table
    assert table.count("| memory.reserved |") == 1


def test_replace_between_needs_its_markers():
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb"
    assert replace_between(text, "x", "new") == "a\n<!-- x:start -->\nnew\n<!-- x:end -->\nb"
    with pytest.raises(ValueError, match="no <!-- y:start -->"):
        replace_between(text, "y", "new")


@pytest.mark.parametrize("claim, fam", [("memory.saved.total", "memory"), ("saved-bytes reduction", "memory"),
                                        ("flops.counter.backward", "flops"), ("per-rank grads bytes", "params / state"),
                                        ("step time (fwd+bwd)", "time"), ("collective calls per step", "comm"),
                                        ("mean train loss over 30 steps", "training")])
def test_claim_families(claim, fam):
    assert family(claim) == fam


def test_plots_are_written_atomically(tmp_path):
    a = predicted_vs_measured([_report()], tmp_path / "pvm.png")
    b = error_distribution([_report()], tmp_path / "err.png")
    assert a.read_bytes()[:8] == PNG and b.read_bytes()[:8] == PNG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["err.png", "pvm.png"]  # no .tmp left behind


def test_gpu_only_kernel_table_marks_the_85pct_bar(tmp_path):
    """The README's GPU-only kernel table (readme.kernels_gpu_only_table): fused rows only, the verdict
    against 85% of the 4.24 TB/s copy computed per row, and the run's source line."""
    import json

    from llm_anatomy.report.readme import kernels_gpu_only_table

    rows = [dict(op=op, impl=impl, gpu_only_us=10.0, gpu_only_tbps=tb, steady_us=20.0, cpu_issue_us=30.0)
            for op, impl, tb in (("rms_norm fwd", "fused", 3.61), ("rms_norm bwd", "fused", 3.59),
                                 ("rms_norm fwd", "plain", 0.3))]
    p = tmp_path / "k.json"
    p.write_text(json.dumps(dict(rows=rows, shape="seed", M=65536, N=512, I=1024, H=8, D=64, gpu="G", torch="t",
                                 cuda="c", date="d", command="cmd")))
    lines = kernels_gpu_only_table(p).splitlines()
    assert [line.split(" | ")[4] for line in lines[2:4]] == ["met", "not met"]  # 3.604 TB/s is the bar
    assert len([line for line in lines if line.startswith("| rms_norm")]) == 2 and "`cmd`" in lines[-1]


def test_power_table_divides_the_peers_times_and_energies(tmp_path):
    """The README's power table (readme.peers_power_table): one row per peer and a ratio row per config, the
    speed-up from the step times and the energy ratio from the energies, HF + Liger's over the lean step's; the
    versions from the run's env record in the source line; a config whose records are missing is left out."""
    import json

    from llm_anatomy.report.readme import peers_power_table

    common = dict(steps=40, samples=300, sm_clock_mhz=1500.0, power_cap_share=1.0, power_limit_w=700.0,
                  max_sm_clock_mhz=1980.0, gpu="G", torch="t", cuda="c", date="d", command="cmd")
    paths = {}
    for peer, ms, w, j in (("efficient-lean", 200.0, 690.0, 140.0), ("hf-liger", 250.0, 692.0, 182.0)):
        paths[peer] = tmp_path / f"{peer}.json"
        paths[peer].write_text(json.dumps(dict(common, peer=peer, step_ms=ms, power_w=w, energy_j_per_step=j)))
    env = tmp_path / "env.json"
    env.write_text(json.dumps(dict(cudnn=91900, triton="3.6.0", driver="580")))
    pair = (paths["efficient-lean"], paths["hf-liger"])
    lines = peers_power_table({"cfg": pair, "absent": (tmp_path / "x.json", tmp_path / "y.json")}, env).splitlines()
    ratio = [line for line in lines if "speed-up" in line]
    assert len(ratio) == 1 and "| 1.250x |" in ratio[0] and ratio[0].endswith("| 1.300x |")
    assert not any("absent" in line for line in lines)
    assert "cuDNN 9.19, Triton 3.6.0, driver 580" in lines[-1] and "`cmd`" in lines[-1]
    assert peers_power_table({"absent": (tmp_path / "x.json", tmp_path / "y.json")}) == "(no power records committed)"


def test_roofline_points_and_roofs(tmp_path):
    """llm_anatomy.report.roofline on a synthetic calibrate profile: one point per measured kernel, work and
    bytes counted as its docstring says, the roofs from the same run, and the fraction of the roof."""
    import json

    from llm_anatomy.report import roofline

    m = dict(matmul_bf16=[dict(m=1024, n=1024, k=1024, ms=0.01, tflops=214.7)], copy_tbps=4.0,
             matmul_bf16_in_step=[dict(m=1024, n=1024, k=1024, ms=0.005)],
             matmul_vocab=[dict(op="grad_weight_acc", rows=8, hidden=16, vocab=32, ms=1.0)],
             attention=[dict(backend="cudnn", B=1, heads=2, S=64, hd=16, fwd_ms=1.0, fwd_bwd_ms=2.0)],
             fused=[dict(op="residual_add", tokens=10, width=8, ms=1.0)])
    prof = dict(measurements=m, provenance=dict(gpu="G", torch="t", cuda="c", date="2026-11-29 00:00", command="cmd"))
    pts = {(p["kind"], p["label"]): p for p in roofline.points(prof)}
    assert len(pts) == 6
    g = pts[("GEMM, in step", "1024x1024x1024")]
    assert (g["flops"], g["bytes"], g["seconds"]) == (2 * 1024**3, 6 * 1024**2, 5e-6)
    assert pts[("LM head GEMM, vocab aligned", "grad_weight_acc 8x16x32")]["bytes"] == 2 * (8 * 16 + 8 * 32) + 8 * 32 * 16
    assert pts[("residual add (ATen)", "residual_add 10x8")]["bytes"] == 10 * 8 * (4 + 2 + 4)
    assert pts[("attention (cudnn)", "fwd+bwd B1 h2 S64 d16")]["flops"] == 3.5 * 2 * 2 * 64 * 64 * 16
    peak, bw = roofline.roofs(prof)
    assert (peak, bw) == (214.7e12, 4e12)
    # 2 GFLOP in 5 us: 429 TFLOP/s, over a 214.7 TFLOP/s roof (intensity 341 FLOP/B is past the ridge)
    assert abs(roofline.of_roof(g, peak, bw) - 2 * 1024**3 / 5e-6 / 214.7e12) < 1e-12
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    roofline.plot(path, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))
    assert "| GEMM, in step | 1 |" in roofline.summary(path)


def test_roofline_counts_flops_for_every_op_calibrate_times():
    """Every op calibrate's fused pass times (calibrate_kernels._fused_cases) has a FLOP count per element in
    the roofline figure, so a new calibrated op cannot break `anatomy report`."""
    from llm_anatomy.measure.calibrate_kernels import _fused_cases
    from llm_anatomy.report.roofline import ELEMENTWISE_FLOPS

    ops = {op for op, *_ in _fused_cases(1024)}
    assert ops and ops <= set(ELEMENTWISE_FLOPS), sorted(ops - set(ELEMENTWISE_FLOPS))


# ---- anatomy report: strict inputs, all or nothing, reproducible --------------------------------------------

def _checkout_copy(tmp_path, claims: bytes | None = None):
    """A checkout for `anatomy report --root`: the documents it rewrites copied, what it only reads linked;
    with `claims`, the CPU claims report is those bytes (gzipped) and the GPU one is absent."""
    import gzip
    import shutil

    from llm_anatomy import records

    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("README.md", "docs"):
        (shutil.copytree if (records.ROOT / name).is_dir() else shutil.copy)(records.ROOT / name, tmp_path / name)
    for name in ("llm_anatomy", "validations", "bench", "scripts", "baselines.json"):
        (tmp_path / name).symlink_to(records.ROOT / name)
    if claims is None:
        (tmp_path / "reports").symlink_to(records.ROOT / "reports")
        return tmp_path
    shutil.copytree(records.ROOT / "reports", tmp_path / "reports", ignore=shutil.ignore_patterns("claims*"))
    (tmp_path / "reports" / "cpu").mkdir(exist_ok=True)
    (tmp_path / "reports" / "cpu" / "claims.json.gz").write_bytes(gzip.compress(claims, mtime=0))
    return tmp_path


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.relative_to(folder).parts[0] in ("README.md", "docs")}


_GOOD_ROW = dict(test="validations/test_x.py::test_y[a]", claim="params", component="model", config="c",
                 variant="baseline", predicted=1, measured=1, error=0.0, tolerance=0.0, unit="", device="cpu",
                 passed=True, note="")


def _bad(kind: str) -> bytes:
    import json

    good = dict(date="2026-12-01", machine={}, command="pytest", rows=[_GOOD_ROW])
    if kind == "not JSON":
        return b'{"rows": [1, 2'
    if kind == "not UTF-8":
        return b'{"rows": [], "date": "\xff\xfe"}'
    if kind == "a list":
        return b"[]"
    if kind == "rows not a list":
        return json.dumps(dict(good, rows={"a": 1})).encode()
    if kind == "missing key":
        return json.dumps(dict(good, rows=[{k: v for k, v in _GOOD_ROW.items() if k != "tolerance"}])).encode()
    if kind == "wrong type":
        return json.dumps(dict(good, rows=[dict(_GOOD_ROW, passed="yes")])).encode()
    if kind == "string number":
        return json.dumps(dict(good, rows=[dict(_GOOD_ROW, error="0.1")])).encode()
    if kind == "NaN":
        return json.dumps(dict(good, rows=[dict(_GOOD_ROW, measured=float("nan"))])).encode()
    if kind == "no machine":
        return json.dumps({k: v for k, v in good.items() if k != "machine"}).encode()
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["not JSON", "not UTF-8", "a list", "rows not a list", "missing key", "wrong type",
                                  "string number", "NaN", "no machine"])
def test_malformed_claims_file_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, kind):
    """A malformed claims report: exit 2, one line on stderr naming the file, no traceback, and the README and
    its images exactly as they were (the reports are checked before anything is rendered)."""
    from llm_anatomy.cli import main

    root = _checkout_copy(tmp_path / "out", claims=_bad(kind))
    before = _snapshot(root)
    assert main(["report", "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reports/cpu/claims.json.gz" in err[0] and "Traceback" not in err[0], err
    assert _snapshot(root) == before


def test_load_accepts_the_committed_claims_reports():
    from llm_anatomy import records
    from llm_anatomy.report import load

    assert all(rep["rows"] for rep in load([records.CPU_CLAIMS, *records.gpu_claims()]))


def test_claims_doc_maps_every_claim_to_a_formula_and_code_that_exist():
    """docs/claims.md's mapping (claims_doc.FAMILIES) covers every claim of the committed reports, and every
    `path:symbol` it names is defined in the tree (where the file moved, in the same folder or once in anatomy/)."""
    from llm_anatomy import records
    from llm_anatomy.report import claims_doc, load

    paths = [records.CPU_CLAIMS, *records.gpu_claims()]
    reports = list(zip(paths, load(paths)))
    assert claims_doc.unmapped(reports) == []
    assert claims_doc.unresolved() == []


def test_claims_doc_lists_an_unmapped_claim_and_its_test(tmp_path):
    from llm_anatomy.report import claims_doc

    rep = _report()
    rep["rows"].append(dict(rep["rows"][0], claim="a claim nobody mapped", test="validations/test_z.py::test_w[p]"))
    doc = claims_doc.render([(tmp_path / "claims.json", rep)])
    line = next(line for line in doc.splitlines() if line.startswith("| a claim nobody mapped |"))
    assert "formula: (unmapped)" in line and "`validations/test_z.py::test_w`" in line
    assert claims_doc.unmapped([(tmp_path / "claims.json", rep)]) == ["a claim nobody mapped"]


@pytest.mark.slow
def test_report_twice_changes_nothing_and_writes_no_absolute_path(tmp_path):
    """`anatomy report` run twice on a copy: the second run changes no byte, and nothing written carries an
    absolute path (this machine's repo or temp folders, or a home or root directory)."""
    import re

    from llm_anatomy import records
    from llm_anatomy.report.regenerate import regenerate

    root = _checkout_copy(tmp_path)
    regenerate(root)
    first = _snapshot(tmp_path)
    regenerate(root)
    assert _snapshot(tmp_path) == first
    assert not list((tmp_path / "docs").rglob("*.tmp*")) and "docs/claims.md" in first
    for name in ("README.md", "docs/results.md", "docs/claims.md"):
        text = first[name].decode()
        for root in (str(records.ROOT), str(tmp_path)):
            assert root not in text, (name, root)
        assert not re.search(r"(?<![\w.])/(home|root|tmp|work|Users)/", text), name


@pytest.mark.slow
def test_a_section_that_fails_to_render_leaves_readme_and_images_untouched(tmp_path, monkeypatch, capsys):
    """All or nothing: the claims plots are drawn before the timing section; when that section fails, no
    image and no README byte has been written (everything is rendered before the first write)."""
    from llm_anatomy.cli import main
    from llm_anatomy.report import probes

    root = _checkout_copy(tmp_path)
    before = _snapshot(tmp_path)

    def fail():
        raise ValueError("timing rows unreadable")

    monkeypatch.setattr(probes, "timing_summary", fail)
    assert main(["report", "--root", str(root)]) == 2
    assert "timing rows unreadable" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


def test_user_docs_links_resolve():
    """Every relative link of the README and the user docs points at a file or folder of the tree."""
    import re

    from llm_anatomy import records

    pages = ["README.md"] + [f"docs/{n}.md" for n in ("planning", "calculator", "memory", "benchmarks",
                                                        "distributed", "history", "claims", "results")]
    for page in pages:
        path = records.ROOT / page
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            assert (path.parent / target.split("#")[0]).exists(), (page, target)


def test_a_row_without_a_measured_figure_loads_and_renders(tmp_path):
    """conftest's unpredicted-OOM row carries null measured and error: a valid claims row, shown without an error."""
    import json

    from llm_anatomy.report import load

    row = dict(_GOOD_ROW, claim="the step fits in GPU memory", measured=None, error=None, passed=False)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(dict(date="d", machine={}, command=None, rows=[row])))
    assert "| the step fits in GPU memory | cpu | model | 1 | 0 | – | exact |" in claims_table(load([p]))


def test_readme_is_a_short_guide_whose_map_names_every_top_level_entry():
    """The README stays a guide (at most 200 lines), its record tables live in docs/results.md, and its map
    names every top-level module and folder of the package and every tracked top-level entry of the repo."""
    import re
    import subprocess

    from llm_anatomy import records

    text = (records.ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    markers = set(re.findall(r"<!-- ([\w-]+):start -->", text))
    assert markers == {"plan-example", "results-summary"}, markers
    block = re.search(r"## Map\n+```\n(.*?)```", text, re.S).group(1)
    words = set(re.findall(r"[\w.]+/?", block))
    pkg = records.PACKAGE
    entries = [p.name + "/" if p.is_dir() else p.name for p in pkg.iterdir()
               if not p.name.startswith("__") and (p.suffix == ".py" or (p / "__init__.py").exists())]
    assert sorted(e for e in entries if e not in words) == []
    r = subprocess.run(["git", "ls-files"], cwd=records.ROOT, capture_output=True, text=True)
    if r.returncode == 0:
        top = {n.split("/")[0] + ("/" if "/" in n else "") for n in r.stdout.split()}
        assert sorted(t for t in top if t not in words and t not in (".gitignore", "README.md")) == []


def test_summary_table_groups_checks_by_what_they_predict():
    from llm_anatomy.report.summary import summary_table

    table = summary_table([_report()], [])
    assert "| peak memory and phases | 1 / 2 | 10.0% | – | – |" in table
    assert "| FLOPs | 1 / 1 | exact | – | – |" in table
    assert "parameters" not in table and "CPU 2026-11-29" in table


def test_readme_summary_is_rendered_from_the_committed_claims_reports():
    """The README's results-summary section is what `anatomy report` renders from the committed reports."""
    import re

    from llm_anatomy import records
    from llm_anatomy.report import load
    from llm_anatomy.report.summary import summary_table

    block = re.search(r"<!-- results-summary:start -->\n(.*?)\n<!-- results-summary:end -->",
                      (records.ROOT / "README.md").read_text(), re.S)
    assert block and block.group(1) == summary_table(load([records.CPU_CLAIMS]), load(records.gpu_claims()))


def test_a_gpu_part_run_joins_the_gpu_claims(tmp_path):
    """A GPU run of one part of the suite (records.GPU_CLAIMS_PARTS) is read beside the whole-suite run: its rows in
    the H200 table and the summary, its own source line (machine, date, command)."""
    import json

    from llm_anatomy import records
    from llm_anatomy.cli import main

    cpu = dict(date="2026-12-01", machine={}, command="pytest", rows=[_GOOD_ROW])
    root = _checkout_copy(tmp_path / "out", claims=json.dumps(cpu).encode())
    part = dict(date="2026-12-06", machine={"gpu": "NVIDIA H200", "torch": "2.11.0"}, command="pytest part-moe",
                rows=[dict(_GOOD_ROW, claim="moe part claim", device="cuda")])
    with records.at(root):
        path = records.GPU_CLAIMS_PARTS[0]
        path.write_text(json.dumps(part))
        assert records.gpu_claims() == [path]
    assert main(["report", "--root", str(root)]) == 0
    results, readme = (root / "docs" / "results.md").read_text(), (root / "README.md").read_text()
    h200 = results.split("<!-- claims-h200:start -->")[1].split("<!-- claims-h200:end -->")[0]
    assert "| moe part claim | cuda |" in h200 and "2026-12-06: `pytest part-moe`" in h200
    assert "H200 2026-12-06" in readme


def test_a_range_claim_measured_at_zero_writes_a_finite_report(tmp_path):
    """A range claim whose measurement is exactly 0 (a gradient equal to one process's) records no relative error
    (None, not inf: JSON has no infinity) and the plots take the report."""
    import json

    import conftest
    from llm_anatomy.report import load
    from llm_anatomy.report.plots import error_distribution

    before = len(conftest._ROWS)
    conftest.Claims("validations/test_x.py::test_zero").within("zero range", low=0.0, high=1e-5, measured=0.0,
                                                               component="moe", config="c", variant="efficient")
    row = conftest._ROWS.pop()
    assert len(conftest._ROWS) == before and row["error"] is None
    p = tmp_path / "claims.json"
    p.write_text(json.dumps(dict(date="2026-12-05", machine={}, command="pytest", rows=[row]), allow_nan=False))
    error_distribution(load([p]), tmp_path / "err.png")
