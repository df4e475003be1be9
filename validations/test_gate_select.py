"""scripts/gate_select.py: which recorded benchmarks the +10% regression gate holds (CPU)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from gate_select import select  # noqa: E402


def _bench(name: str, median: float, iqr: float) -> dict:
    return dict(fullname=f"validations/test_benchmarks.py::{name}", stats=dict(median=median, iqr=iqr))


def test_select_keeps_the_seed_steps_stable_gpu_bound_benchmarks():
    data = dict(benchmarks=[
        _bench("test_model[seed-B16-S4096/efficient/model/fwd+bwd]", 43e-3, 0.9e-3),  # kept
        _bench("test_model[seed-B16-S4096/efficient/model/fwd]", 22.8e-3, 4.3e-3),  # IQR 19%: noisy
        _bench("test_component[seed-B16-S4096/efficient/norm/fwd]", 0.15e-3, 0.001e-3),  # sub-ms: host-bound
        _bench("test_component[seed-narrow-B4-S1024/baseline/loss/fwd+bwd]", 1.4e-3, 0.03e-3),  # quick config
        _bench("test_component[seed-B16-S4096/baseline/attention/fwd]", 29e-3, 1.45e-3),  # IQR exactly 5%: kept
    ])
    assert select(data) == ["validations/test_benchmarks.py::test_component[seed-B16-S4096/baseline/attention/fwd]",
                            "validations/test_benchmarks.py::test_model[seed-B16-S4096/efficient/model/fwd+bwd]"]
    assert select(data, config="seed-narrow-B4-S1024") == [
        "validations/test_benchmarks.py::test_component[seed-narrow-B4-S1024/baseline/loss/fwd+bwd]"]
    assert select(data, max_iqr=0.2) == sorted(select(data) + [
        "validations/test_benchmarks.py::test_model[seed-B16-S4096/efficient/model/fwd]"])


def test_the_committed_baseline_gates_ids_the_suite_still_has():
    """baselines.json (recorded on an H200) gates the seed step's model benchmarks,
    and every gated id is one the suite collects today (a renamed id would go ungated)."""
    ids = select(json.loads((ROOT / "baselines.json").read_text()))
    assert len(ids) >= 8 and all("[seed-B16-S4096/" in i for i in ids)
    assert {f"validations/test_benchmarks.py::test_model[seed-B16-S4096/{v}/model/fwd+bwd]"
            for v in ("baseline", "efficient")} <= set(ids)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"{len(ids)} tests collected" in r.stdout, r.stdout[-800:] + r.stderr[-800:]


def test_bad_file_is_one_line_and_exit_2(tmp_path):
    for arg in (str(tmp_path / "missing.json"), str(tmp_path / "empty.json")):
        (tmp_path / "empty.json").write_text(json.dumps(dict(benchmarks=[])))
        r = subprocess.run([sys.executable, str(ROOT / "scripts/gate_select.py"), arg], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("gate_select: error:")
