"""`anatomy train`: both variants follow one loss curve, kill-and-resume repeats it exactly, the
embedded corpus and tokenizer need no network, NaN stops cleanly, bad input is one line and exit 2.

Every run here is the tiny GQA config on the embedded corpus (BPE vocab 512), B=4, S=64, on CPU with
one intra-op thread: the suite shares 2 cores, and a resumed run must use the thread count of the
run it repeats (a reduction's order may depend on it).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.train import checkpoint as ckpt
from llm_anatomy.train import cli
from llm_anatomy.train.data import Batches, load_data
from llm_anatomy.train.loop import Diverged, TrainOptions, train
from llm_anatomy.train.resume import latest
from llm_anatomy.train.tokenizer import EOT
from validations import train_cases

SHAPE = train_cases.SHAPE
one_thread, cache = train_cases.one_thread, train_cases.cache  # the module fixtures
TINY = ModelConfig(name="tiny-gqa", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
STEPS = 30
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                    os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def data(cache):
    return load_data(None, TINY.vocab, cache_dir=cache, seq=64)


def _curve(data, tmp: Path, variant: str, policy: str, param_dtype=None, steps=STEPS) -> torch.Tensor:
    o = TrainOptions(steps=steps, eval_every=0, progress="none", plot=False, out=str(tmp), param_dtype=param_dtype,
                     optimizer="ademamix")  # the variants' AdEMAMix pair: the loop against the foreach step
    return torch.tensor(train(TINY, Run(4, 64, policy), variant, data, o)["history"]["loss"], dtype=torch.float64)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def _float64_throughout():
    """Keep a float64 model float64 end to end. The baseline upcasts with `.float()` (softmax, RMSNorm,
    the loss) and builds the RoPE tables in fp32; on a float64 model those would round to fp32, so
    the reference would share fp32 roundings with the runs it judges and understate their error
    (measured: it halves the fp32 baseline's curve error, 8.4e-8 -> 4.6e-8)."""
    import llm_anatomy.baseline.transformer as bt

    to_float = torch.Tensor.float

    def keep64(self, *a, **k):
        return self if self.dtype == torch.float64 else to_float(self, *a, **k)

    def rope64(seq, head_dim, theta, device, dtype):
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
        f = torch.outer(torch.arange(seq, device=device, dtype=torch.float64), inv)
        e = torch.cat((f, f), dim=-1)
        return e.cos().to(dtype), e.sin().to(dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "float", keep64)
        mp.setattr(bt, "rope_tables", rope64)
        yield


@pytest.fixture(scope="module")
def fp64_curve(data, tmp_path_factory):
    """The baseline + AdEMAMix in float64 throughout: the reference every curve is judged against."""
    with _float64_throughout():
        return _curve(data, tmp_path_factory.mktemp("ref"), "baseline", "fp32", param_dtype="float64")


# ---- 1. the two variants follow one loss curve ------------------------------------------------------
@pytest.mark.parametrize("policy", ["fp32", "amp"])
def test_variants_follow_the_same_loss_curve(policy, data, fp64_curve, tmp_path, claims):
    """From the same initial weights (the efficient model loads the baseline's) and the same batches,
    the efficient model + FusedAdEMAMix follow the baseline + AdEMAMix for 30 steps.

    Tolerance, DESIGN.md's rule for numerical claims: error(efficient) <= 2 × error(baseline, same
    policy), each the relative L2 distance of the 30-step loss curve from the float64 baseline's.
    No floor: a 30-step curve's error is never zero by accident. Measured (torch 2.13, CPU, 1
    thread): fp32 baseline 8.4e-8, efficient 5.9e-8; amp 2.34e-5 and 2.41e-5."""
    base = _curve(data, tmp_path / "b", "baseline", policy)
    eff = _curve(data, tmp_path / "e", "efficient", policy)
    err_b, err_e = _rel(base, fp64_curve), _rel(eff, fp64_curve)
    bound = 2 * err_b
    # the row: the efficient curve's mean loss against the baseline's; |e - b| <= |e - ref| + |b - ref|
    claims.check("mean train loss over 30 steps, efficient vs baseline (same init, same batches)",
                 component="train", config=TINY.name, variant=f"efficient/{policy}", predicted=base.mean().item(),
                 measured=eff.mean().item(), tolerance=bound + err_b, unit="nats",
                 note=f"curve error vs float64: baseline {err_b:.2e}, efficient {err_e:.2e}")
    assert err_e <= bound, f"{policy}: efficient curve error {err_e:.3e} > 2 × baseline's {err_b:.3e}"
    assert base[-1] < base[0] - 0.2, "the curve must actually descend for the comparison to mean anything"


def test_recompute_trains_the_same_curve(data, tmp_path, monkeypatch):
    """`anatomy train --variant efficient --recompute mlp` runs the recomputing model (Run.recompute in
    its log's identity) and, recompute being exact, follows the plain efficient curve bit for bit."""
    from llm_anatomy.train import setup

    built, init = [], setup.init_model
    monkeypatch.setattr(setup, "init_model", lambda *a, **k: built.append(init(*a, **k)) or built[-1])
    plain = train(TINY, Run(4, 64, "fp32"), "efficient", data, TrainOptions(steps=4, eval_every=0, progress="none",
                                                                           plot=False, out=str(tmp_path / "p")))
    rec = train(TINY, Run(4, 64, "fp32", "mlp"), "efficient", data, TrainOptions(steps=4, eval_every=0,
                                                                                progress="none", plot=False,
                                                                                out=str(tmp_path / "r")))
    assert [m.recompute for m in built] == ["none", "mlp"]
    assert rec["history"]["loss"] == plain["history"]["loss"] and len(plain["history"]["loss"]) == 4
    log = json.loads((tmp_path / "r" / "train_log.json").read_text())
    assert log["run"]["recompute"] == "mlp" and "recompute" not in json.loads(
        (tmp_path / "p" / "train_log.json").read_text())["run"]


# ---- 2. kill and resume -----------------------------------------------------------------------------
def _run_cli(args: list[str], env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm_anatomy.train.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env or ENV)


def _losses(out: Path) -> list[float]:
    return [s["loss"] for s in json.loads((out / "train_log.json").read_text())["steps"]]


@pytest.mark.parametrize("variant, policy, fault", [
    ("baseline", "fp32", "kill-after-step:6"),  # SIGKILL between steps: resume from step 4
    ("efficient", "fp32", "kill-in-save:8"),  # SIGKILL inside the step-8 save, before its commit
    ("efficient", "amp", "kill-after-step:5"),
])
def test_kill_and_resume_repeats_the_curve_exactly(variant, policy, fault, cache, tmp_path, claims):
    """A run SIGKILLed mid-way and resumed with --resume gives the uninterrupted run's loss curve,
    bit for bit (fp32 and amp on CPU: the kernels are deterministic at a fixed thread count)."""
    common = [*SHAPE, "--variant", variant, "--dtype", policy, "--steps", "12", "--eval-every", "4",
              "--cache-dir", str(cache), "--seed", "3"]
    assert cli.main([*common, "--ckpt-dir", str(tmp_path / "whole")]) == 0
    want = _losses(tmp_path / "whole")

    ck = tmp_path / "killed"
    r = _run_cli([*common, "--ckpt-dir", str(ck)], env=dict(ENV, ANATOMY_TRAIN_FAULT=fault))
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert latest(ck) == ckpt.step_dir(ck, 4)  # the last committed checkpoint
    if fault.startswith("kill-in-save"):
        assert any(ck.glob(".tmp-step-00000008-*/manifest.json")) and not ckpt.step_dir(ck, 8).exists()
    assert cli.main([*common, "--ckpt-dir", str(ck), "--resume"]) == 0
    got = _losses(ck)
    claims.check("loss after kill + resume equals the uninterrupted run's", component="train",
                 config=TINY.name, variant=f"{variant}/{policy}", predicted=want[-1], measured=got[-1],
                 unit="nats", note=f"{fault}; all 12 steps compared exactly")
    assert got == want


# ---- 3. embedded corpus, tokenizer, cache, no network -----------------------------------------------
def test_default_corpus_and_tokenizer_offline_then_cached(tmp_path, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = load_data(None, 512, cache_dir=tmp_path, seq=64)
    assert first.tokenizer["cache_hit"] is False and first.tokenizer["vocab_size"] == 512
    entry = Path(first.tokenizer["path"])
    assert entry.parent == tmp_path and entry.name.endswith("-v512")
    mtime = (entry / "tokenizer.json").stat().st_mtime_ns
    second = load_data(None, 512, cache_dir=tmp_path, seq=64)
    assert second.tokenizer["cache_hit"] is True and second.tokenizer["path"] == str(entry)
    assert (entry / "tokenizer.json").stat().st_mtime_ns == mtime  # read, not retrained
    assert np.array_equal(np.concatenate([first.train, first.eval]), np.concatenate([second.train, second.eval]))
    other = load_data(None, 1024, cache_dir=tmp_path, seq=64)  # the vocab is part of the key
    assert Path(other.tokenizer["path"]) != entry and other.tokenizer["cache_hit"] is False

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(entry / "tokenizer.json"))
    text = "The while statement is used for repeated execution."
    assert tok.decode(tok.encode(text).ids) == text
    eot = tok.token_to_id(EOT)
    assert int((first.train == eot).sum()) > 40  # one per document: the corpus holds 61
    assert first.train.size > 9 * first.eval.size * 0.99  # the 90/10 split


def test_text_files_and_bin_sources(tmp_path, cache):
    """Your .txt files train their own tokenizer; a nanoGPT-style .bin is read as ids, split the same way."""
    docs = [tmp_path / f"d{i}.txt" for i in range(3)]
    for i, d in enumerate(docs):
        d.write_text(f"document {i}: " + " ".join(f"word{j % 97}" for j in range(3000)) + "\n")
    txt = load_data([str(p) for p in docs], 300, cache_dir=cache, seq=16)
    assert txt.tokenizer["cache_hit"] is False and txt.train.max() < 300
    ids = np.arange(5000, dtype=np.uint32) % 300
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    b = load_data([str(tmp_path / "t.bin")], 300, bin_dtype="uint32", seq=16)
    assert np.array_equal(np.concatenate([b.train, b.eval]), ids) and b.eval.size == 500
    x, y = Batches(b.train, 4, 16, seed=0).get(0, "cpu")
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_saved_hf_dataset_source(tmp_path, cache, monkeypatch):
    """A folder saved by datasets.save_to_disk: a text column is tokenized (cached by the dataset's
    fingerprint), an input_ids column is taken as tokens. `datasets` is stood in for by a fake with
    the three things the loader touches (load_from_disk, DatasetDict, a Dataset's slices)."""
    import types

    class Dataset:
        def __init__(self, cols):
            self.cols, self.column_names, self._fingerprint = cols, list(cols), f"fp-{len(cols)}-{sorted(cols)}"

        def __len__(self):
            return len(next(iter(self.cols.values())))

        def __getitem__(self, k):
            return self.cols[k] if isinstance(k, str) else {c: v[k] for c, v in self.cols.items()}

    class DatasetDict(dict):
        pass

    texts = [f"row {i}: " + " ".join(f"tok{(i * j) % 50}" for j in range(200)) for i in range(40)]
    ids = [[(i + j) % 300 for j in range(100)] for i in range(40)]
    saved = {"text": DatasetDict(train=Dataset({"text": texts})), "ids": Dataset({"input_ids": ids})}
    fake = types.SimpleNamespace(DatasetDict=DatasetDict, load_from_disk=lambda p: saved[Path(p).name])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    for name in saved:
        (tmp_path / name).mkdir()
        (tmp_path / name / "dataset_info.json").write_text("{}")
    d = load_data([str(tmp_path / "text")], 300, cache_dir=cache, seq=16)
    assert d.tokenizer["cache_hit"] is False and d.source.startswith("Hugging Face dataset")
    assert load_data([str(tmp_path / "text")], 300, cache_dir=cache, seq=16).tokenizer["cache_hit"] is True
    t = load_data([str(tmp_path / "ids")], 300, cache_dir=cache, seq=16)
    assert np.array_equal(np.concatenate([t.train, t.eval]), np.concatenate([np.array(r) for r in ids]))


# ---- 4. NaN stops the run, the last good checkpoint survives ----------------------------------------
@pytest.mark.parametrize("args, env, bad_step, last_good", [
    pytest.param(["--lr", "1e-3"], {"ANATOMY_TRAIN_FAULT": "nan-at-step:5"}, 5, 4, id="injected-nan-loss"),
    pytest.param(["--lr", "1e10"], {}, 2, 1, id="absurd-lr"),
])
def test_nan_stops_with_one_line_and_keeps_the_last_good_checkpoint(args, env, bad_step, last_good, cache, tmp_path,
                                                                    monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ck = tmp_path / "ck"
    rc = cli.main([*SHAPE, *args, "--variant", "baseline", "--dtype", "fp32", "--steps", "10", "--eval-every", "100", "--ckpt-every", "1",
                   "--keep", "0", "--cache-dir", str(cache), "--ckpt-dir", str(ck)])
    err = capsys.readouterr().err.strip()
    assert rc == cli.EXIT_DIVERGED, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "nan" in err.lower() and f"at step {bad_step}" in err and str(ckpt.step_dir(ck, last_good)) in err, err
    assert latest(ck) == ckpt.step_dir(ck, last_good)
    assert not ckpt.step_dir(ck, bad_step).exists()
    log = json.loads((ck / "train_log.json").read_text())
    assert log["status"] == "diverged" and len(log["steps"]) == bad_step - 1
    # the survivor loads, and holds finite weights
    from llm_anatomy.train.loop import init_model, make_optimizer

    o = TrainOptions(steps=10)
    model = init_model(TINY, "baseline", "cpu", torch.float32, seed=1)
    tr = ckpt.load(latest(ck), model, make_optimizer(o.optimizer, "baseline", model, o, torch.device("cpu")))
    assert tr["step"] == last_good and all(torch.isfinite(p).all() for p in model.parameters())


def test_loss_hook_diverged_is_an_exception_in_the_api(data, tmp_path):
    o = TrainOptions(steps=3, eval_every=0, progress="none", plot=False, out=str(tmp_path))
    with pytest.raises(Diverged, match="loss is inf at step 2"):
        train(TINY, Run(4, 64, "fp32"), "baseline", data, o, loss_hook=lambda s, l: l * float("inf") if s == 2 else l)


# ---- 5. bad input -----------------------------------------------------------------------------------
def _bad_bin(tmp_path: Path, kind: str) -> str:
    p = tmp_path / f"{kind}.bin"
    p.write_bytes(b"\x01\x02\x03" if kind == "odd" else (np.arange(3000, dtype=np.uint16) % 1000).tobytes())
    return str(p)


BAD = {  # id: (arguments, what the one line must say)
    "missing-file": (["--data", "/no/such/file.txt"], "no such data file"),
    "unsupported-file": (["--data", "{tmp}/x.csv"], "unsupported data file"),
    "bin-odd-size": (["--data", "{odd.bin}", "--vocab", "512"], "not a whole number of uint16"),
    "bin-id-over-vocab": (["--data", "{big.bin}"], "holds token id 999"),
    "hf-without-datasets": (["--data", "{hf}"], "pip install datasets"),
    "steps-0": (["--steps", "0"], "--steps must be a positive integer"),
    "lr-nan": (["--lr", "nan"], "--lr must be a positive number"),
    "lr-overflow": (["--lr", "1e39"], "overflows the parameters' dtype"),
    "lr-first-update-overflows": (["--lr", "3e38", "--weight-decay", "10", "--dtype", "fp32", "--optimizer",
                                   "ademamix"], "makes the first update non-finite"),
    "lr-adamw-update-overflows": (["--lr", "3e38", "--weight-decay", "10", "--dtype", "fp32"],
                                  "overflows the optimizer's update at step 1"),
    "optimizer": (["--optimizer", "sgd"], "--optimizer must be one of"),
    "variant": (["--variant", "turbo"], "unknown variant"),
    "recompute-baseline": (["--variant", "baseline", "--recompute", "mlp"], "option of the efficient variant"),
    "lean-baseline": (["--variant", "baseline", "--lean"], "option of the efficient variant"),
    "recompute-value": (["--variant", "efficient", "--recompute", "all"], "recompute must be one of"),
    "batch-0": (["--batch", "0"], "batch must be a positive integer"),
    "vocab-under-bpe": (["--vocab", "100"], "too small for a byte-level BPE"),
    "seq-over-data": (["--seq", "200000"], "too few for --seq 200000"),
    "resume-missing": (["--resume", "/no/such/ckpt"], "no such checkpoint"),
    "resume-no-ckpt-dir": (["--resume"], "needs --ckpt-dir"),
    "ddp-without-torchrun": (["--strategy", "ddp"], "launch with torchrun"),
    "device": (["--device", "tpu"], "--device must be cpu or cuda"),
    "unknown-flag": (["--no-such-flag"], "unrecognized arguments"),
    "steps-not-int": (["--steps", "ten"], "invalid int value"),
}


@pytest.mark.parametrize("args, needle", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_one_line_exit_2(args, needle, cache, tmp_path, capsys):
    if needle == "pip install datasets":
        try:
            import datasets  # noqa: F401

            pytest.skip("datasets is installed: the missing-package message cannot be shown")
        except ImportError:
            pass
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "dataset_info.json").write_text("{}")
    (tmp_path / "x.csv").write_text("a,b\n")
    subs = {"{tmp}": str(tmp_path), "{odd.bin}": _bad_bin(tmp_path, "odd"), "{big.bin}": _bad_bin(tmp_path, "big"),
            "{hf}": str(hf)}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    base = [*SHAPE, "--steps", "2", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]
    rc = cli.main([*base, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("anatomy train: error:"), err


def test_bad_input_exit_code_of_the_process(tmp_path):
    r = _run_cli(["--data", str(tmp_path / "missing.txt")])
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no such data file" in r.stderr


# ---- 6. torchrun: DDP (baseline) and FSDP2 (efficient) ----------------------------------------------
CLAIM_TWO_RANKS = {"ddp": "mean train loss over 30 steps, ddp on 2 ranks vs one process",
                   "fsdp": "mean train loss over 30 steps, fsdp on 2 ranks vs one process"}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("variant, strategy", [("baseline", "ddp"), ("efficient", "fsdp")])
def test_torchrun_two_ranks_follow_the_one_process_curve(variant, strategy, cache, fp64_curve, data, tmp_path,
                                                         claims):
    """Two gloo ranks × B=2 see the same 4 samples per step as one process with B=4 (rank r takes
    samples consumed + 2r ...), and DDP/FSDP average the gradients, so the curve is the one-process
    curve up to rounding: judged like claim 1, against the same float64 reference, within 2× the
    one-process baseline's own error. Then the run resumes from its sharded checkpoint."""
    out = tmp_path / "run"
    args = [*SHAPE, "--batch", "2", "--variant", variant, "--dtype", "fp32", "--steps", str(STEPS),
            "--eval-every", "10", "--ckpt-dir", str(out), "--cache-dir", str(cache),
            "--optimizer", "ademamix"]  # the optimizer of _curve and the float64 reference
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "llm_anatomy.train.cli", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-8000:]  # the ranks' own lines come before torchrun's summary
    log = json.loads((out / "train_log.json").read_text())
    assert log["strategy"] == strategy and log["world"] == 2
    got = torch.tensor(_losses(out), dtype=torch.float64)
    one = _curve(data, tmp_path / "one", "baseline", "fp32")
    err_one, err_dist = _rel(one, fp64_curve), _rel(got, fp64_curve)
    bound = 2 * err_one
    claims.check(CLAIM_TWO_RANKS[strategy], component="comm",
                 config=TINY.name, variant=f"{variant}/fp32", predicted=one.mean().item(),
                 measured=got.mean().item(), tolerance=bound + err_one, unit="nats",
                 note=f"curve error vs float64: one process {err_one:.2e}, {strategy} {err_dist:.2e}")
    assert err_dist <= bound, f"{strategy}: curve error {err_dist:.3e} > 2 × one process's {err_one:.3e}"
    shard = ckpt.step_dir(out, 30) / "shard-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x01  # in the last tensor's bytes
    shard.write_bytes(bytes(raw))
    again = tmp_path / "again"
    r = subprocess.run([*cmd, "--resume", "--out", str(again)], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-8000:]  # the ranks' own lines come before torchrun's summary
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("anatomy train: warning:")]
    assert len(warnings) == 1 and "step-00000030" in warnings[0] and "shard-00001-of-00002" in warnings[0], r.stderr
    assert json.loads((again / "train_log.json").read_text())["start_step"] == 20
    assert _losses(again) == _losses(out)

