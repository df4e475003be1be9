"""Claims: `anatomy train --tp N` and `--pp N` (llm_anatomy/train/mesh.py) train as one process does.

  gloo, 2 ranks   TP 2; PP 2 with --pp-schedule 1f1b and interleaved-1f1b (2 micro-batches): each 4-step loss curve,
                  its evals and its gradient norms (before the clip, train_log.json) against the one-process
                  `anatomy train` run on the same data: the norm under PP combines the stages
  gloo, 4 ranks   TP 2 x FSDP 2 and PP 2 (1f1b) x FSDP 2 (B = 2 per dp rank against one process's B = 4)
  efficient       TP 2 and TP 2 x FSDP 2 of the efficient variant (its plain block) against its one-process run
  resume          TP 2 (both variants), PP 2 (interleaved), TP 2 x FSDP 2, PP 2 x FSDP 2: 2 steps + resume 2 from
                  the per-rank checkpoint = the 4 straight steps, exactly (CPU kernels are deterministic); a checkpoint resumed on another mesh is refused
                  in one line, on every rank (exit 2), in a launch and in one process
  tolerances      the engine tests': TP's CURVE_TOL (validations/test_tensor_parallel.py: 1e-5 relative per step,
                  reduction order only); PP's float64 rule (validations/test_pipeline_parallel.py: the curve's
                  relative error against the one-process float64 run within twice the one-process fp32 run's own,
                  or twice one fp32 rounding where that is smaller)
  bad input       one line on stderr, exit 2, before any process group is made
Every launch of a world size runs in ONE spawn (distributed.train_step.spawn), its runs in order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from llm_anatomy.config import ModelConfig, Run
from llm_anatomy.distributed import train_step
from llm_anatomy.train import cli
from llm_anatomy.train.data import load_data
from llm_anatomy.train.loop import TrainOptions, train
from validations.test_train import _float64_throughout
from validations.train_cases import cache, one_thread  # noqa: F401 (module fixtures)

CURVE_TOL = 1e-5  # validations/test_tensor_parallel.py's, for TP
CFG = ModelConfig(name="custom", hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=512)
STEPS, CLIP = 4, 0.5
FLAGS = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
         "--vocab", "512", "--seq", "32", "--device", "cpu", "--progress", "none", "--variant", "baseline",
         "--dtype", "fp32", "--steps", str(STEPS), "--eval-every", "2", "--grad-clip", str(CLIP)]
PIPE = {"pp2-1f1b": ["--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2"],
        "pp2-interleaved": ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--microbatches", "2"]}
EFF = ["--variant", "efficient"]  # under --tp the lean block is off by default (cli_args.run_from_args)


def _rank_cli(args: list[str]) -> int:
    """One `anatomy train` on a spawned rank, as under torchrun (the group exists; the run does not own it)."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
    return cli.main(args)


def _log(out: Path) -> dict:
    return json.loads((out / "train_log.json").read_text())


def _losses(out: Path) -> list[float]:
    return [s["loss"] for s in _log(out)["steps"]]


def _evals(out: Path) -> list[float]:
    return [e["loss"] for e in _log(out)["eval"]]


@pytest.fixture(scope="module")
def one_process(cache, tmp_path_factory) -> dict[str, Path]:
    """The one-process runs: the baseline in fp32 (the reference) and in float64 (PP's judge), the efficient model
    (without its lean block) in fp32."""
    data = load_data(None, CFG.vocab, cache_dir=cache, seq=32)
    out = {}
    for name, variant, pdt in (("fp32", "baseline", None), ("fp64", "baseline", "float64"),
                               ("efficient", "efficient", None)):
        d = out[name] = tmp_path_factory.mktemp(name)
        o = TrainOptions(steps=STEPS, eval_every=2, grad_clip=CLIP, progress="none", plot=False, out=str(d),
                         param_dtype=pdt)
        if pdt:
            with _float64_throughout():
                train(CFG, Run(4, 32, "fp32"), variant, data, o)
        else:
            train(CFG, Run(4, 32, "fp32"), variant, data, o)  # Run.lean is off by default
    return out


@pytest.fixture(scope="module")
def launched(one_process, cache, tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """Every mesh run, one spawn per world size: name -> (each rank's exit code, its run directory)."""
    base = tmp_path_factory.mktemp("mesh")
    common = [*FLAGS, "--cache-dir", str(cache)]  # the tokenizer one_process trained
    runs = {2: {"tp2": ["--batch", "4", "--tp", "2", "--ckpt-every", "2"],
                "tp2-resumed": ["--batch", "4", "--tp", "2", "--ckpt-dir", str(base / "tp2"), "--resume",
                                str(base / "tp2" / "step-00000002")],
                "tp2-on-pp2": ["--batch", "4", *PIPE["pp2-1f1b"], "--ckpt-dir", str(base / "tp2"), "--resume"],
                **{k: ["--batch", "4", *v, "--ckpt-every", "2"] for k, v in PIPE.items()},
                "pp2-efficient": ["--batch", "4", *PIPE["pp2-1f1b"], "--variant", "efficient", "--no-lean"],
                "tp2-efficient": ["--batch", "4", "--tp", "2", *EFF, "--ckpt-every", "2"],
                "tp2-efficient-resumed": ["--batch", "4", "--tp", "2", *EFF, "--ckpt-dir", str(base / "tp2-efficient"),
                                          "--resume", str(base / "tp2-efficient" / "step-00000002")],
                "pp2-interleaved-resumed": ["--batch", "4", *PIPE["pp2-interleaved"], "--ckpt-dir",
                                            str(base / "pp2-interleaved"), "--resume",
                                            str(base / "pp2-interleaved" / "step-00000002")]},
            4: {"tp2xdp2": ["--batch", "2", "--tp", "2", "--ckpt-every", "2"],
                "pp2xdp2": ["--batch", "2", *PIPE["pp2-1f1b"], "--ckpt-every", "2"],
                "tp2xdp2-efficient": ["--batch", "2", "--tp", "2", *EFF],
                **{f"{k}-resumed": ["--batch", "2", *flags, "--ckpt-dir", str(base / k), "--resume",
                                    str(base / k / "step-00000002")]
                   for k, flags in (("tp2xdp2", ["--tp", "2"]), ("pp2xdp2", PIPE["pp2-1f1b"]))}}}
    out = {}
    for world, named in runs.items():
        scenarios = []
        for name, args in named.items():
            where = ["--out", str(base / name)] if "--ckpt-dir" in args else ["--ckpt-dir", str(base / name)]
            scenarios.append(dict(args=[*common, *args, *where]))
        codes = train_step.spawn(world, scenarios, fn=_rank_cli)
        for i, name in enumerate(named):
            out[name] = ([codes[r][i] for r in range(world)], base / name)
    return out


def _ok(launched, name: str) -> Path:
    codes, d = launched[name]
    assert codes == [0] * len(codes), f"{name}: exit codes {codes}"
    return d


def _norms(out: Path) -> list[float]:
    return [s["grad_norm"] for s in _log(out)["steps"]]


def _check_norms(d: Path, one: Path, name: str, claims) -> None:
    """The gradient norm each step (before the clip) equals the one-process run's within CURVE_TOL; the clip acts
    (the norm exceeds it), so a wrong norm would also move the curve."""
    assert all(n > CLIP for n in _norms(one)), _norms(one)
    for step, (got, want) in enumerate(zip(_norms(d), _norms(one), strict=True), 1):
        claims.check(f"anatomy train gradient norm vs one process ({name})", component="loss", config=CFG.name,
                     variant="baseline", predicted=want, measured=got, tolerance=CURVE_TOL, unit="",
                     note=f"step {step}, fp32, clipped to {CLIP}")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp2", "tp2xdp2", "tp2-efficient", "tp2xdp2-efficient"])
def test_tp_curve_matches_one_process(launched, one_process, name, claims):
    """TP 2 (and TP 2 x FSDP 2 with half the batch per dp rank), of either variant, follow the one-process run of
    that variant step by step, evals and gradient norms included, within CURVE_TOL."""
    ref = one_process["efficient" if name.endswith("efficient") else "fp32"]
    d, one = _ok(launched, name), _losses(ref)
    log = _log(d)
    assert log["strategy"] == "tp" and log["mesh"] == ("tp 2 x dp 2" if "xdp2" in name else "tp 2 x dp 1")
    assert log["variant"] == ("efficient" if name.endswith("efficient") else "baseline")
    _check_norms(d, ref, name, claims)
    for step, (got, want) in enumerate(zip(_losses(d), one), 1):
        claims.check(f"anatomy train --tp loss vs one process ({name})", component="loss", config=CFG.name,
                     variant="baseline", predicted=want, measured=got, tolerance=CURVE_TOL, unit="nats",
                     note=f"step {step}, fp32, grad clip {CLIP}")
    for got, want in zip(_evals(d), _evals(ref), strict=True):
        claims.check(f"anatomy train --tp eval loss vs one process ({name})", component="loss", config=CFG.name,
                     variant="baseline", predicted=want, measured=got, tolerance=CURVE_TOL, unit="nats")


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*PIPE, "pp2xdp2"])
def test_pp_curve_matches_one_process(launched, one_process, name, claims):
    """A 2-stage pipeline (either schedule, 2 micro-batches; x FSDP 2 with B=2 per dp rank) against the one-process
    run: the curve's relative error against float64 within twice the one-process fp32 run's own (or twice one fp32
    rounding); the clip combines the stages' norms (a rank's own norm alone would clip by another factor)."""
    d = _ok(launched, name)
    assert _log(d)["strategy"] == "pp" and _log(d)["mesh"].startswith("pp 2 (")
    _check_norms(d, one_process["fp32"], name, claims)
    ref64, ref32, got = (_losses(one_process["fp64"]), _losses(one_process["fp32"]), _losses(d))
    err = lambda xs: max(abs(x - y) / abs(y) for x, y in zip(xs, ref64, strict=True))  # noqa: E731
    bound = 2 * max(err(ref32), 2.0 ** -24)
    claims.within(f"anatomy train --pp loss curve, relative error against float64 ({name})", low=0.0, high=bound,
                  measured=err(got), component="loss", config=CFG.name, variant="baseline", unit="rel",
                  note=f"pipeline {got}, one process fp32 {ref32}, float64 {ref64}")
    ev64 = _evals(one_process["fp64"])
    ev_err = max(abs(x - y) / y for x, y in zip(_evals(d), ev64, strict=True))
    assert ev_err <= 2 * max(max(abs(x - y) / y for x, y in zip(_evals(one_process["fp32"]), ev64)), 2.0 ** -24)


@pytest.mark.distributed
def test_pp_efficient_matches_one_process(launched, one_process, claims):
    """The efficient variant (without its lean block, which hands a pending branch across Blocks) as a 2-stage
    pipeline: its losses, evals and gradient norms equal its one-process run's within CURVE_TOL."""
    d, one = _ok(launched, "pp2-efficient"), one_process["efficient"]
    assert _log(d)["variant"] == "efficient"
    _check_norms(d, one, "pp2-efficient", claims)
    for got, want in zip(_losses(d) + _evals(d), _losses(one) + _evals(one), strict=True):
        claims.check("anatomy train --pp (efficient) loss vs one process", component="loss", config=CFG.name,
                     variant="efficient", predicted=want, measured=got, tolerance=CURVE_TOL, unit="nats")


@pytest.mark.distributed
@pytest.mark.parametrize("name, world", [("tp2", 2), ("tp2-efficient", 2), ("pp2-interleaved", 2), ("tp2xdp2", 4),
                                         ("pp2xdp2", 4)])
def test_resume_on_the_same_mesh_repeats_the_run(launched, name, world):
    """2 steps, then a resume from the step-2 per-rank checkpoint for 2 more: the 4 straight steps' losses and
    evals, bit for bit; each rank wrote its own shard (TP's DTensors, FSDP2's dp shards of them, a stage's
    tensors, a stage's dp shards)."""
    straight, resumed = _ok(launched, name), _ok(launched, f"{name}-resumed")
    assert _log(resumed)["start_step"] == 2
    assert _losses(resumed) == _losses(straight) and _evals(resumed) == _evals(straight)
    shards = sorted(p.name for p in (straight / "step-00000002").glob("shard-*"))
    assert shards == [f"shard-{r:05d}-of-{world:05d}.safetensors" for r in range(world)]


@pytest.mark.distributed
def test_resume_on_another_mesh_refused(launched, cache, tmp_path, capsys):
    """The TP 2 checkpoint resumed as a pipeline (every rank exits 2 together) or in one process: one line."""
    codes, _ = launched["tp2-on-pp2"]
    assert codes == [2, 2]
    tp_dir = _ok(launched, "tp2")
    rc = cli.main([*FLAGS, "--batch", "4", "--cache-dir", str(cache), "--ckpt-dir", str(tp_dir), "--resume",
                   "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "written on the mesh tp 2 x dp 1, this run is on no mesh" in err, err


BAD = {
    "tp-not-dividing": (2, ["--tp", "3"], "--tp 3 does not divide the world size 2"),
    "tp-without-torchrun": (None, ["--tp", "2"], "launch with torchrun"),
    "tp-efficient-lean": (2, ["--tp", "2", "--variant", "efficient", "--lean"], "without its lean block (--no-lean)"),
    "tp-and-pp-not-dividing": (6, ["--tp", "2", "--pp", "2"], "--pp 2 x --tp 2 = 4 ranks does not divide"),
    "tp-ddp": (2, ["--tp", "2", "--strategy", "ddp"], "--strategy must be auto or fsdp"),
    "tp-zero": (2, ["--tp", "0"], "--tp must be a positive integer"),
    "pp-tied": (2, ["--pp", "2", "--tie-embeddings"], "tie_embeddings"),
    "pp-schedule": (2, ["--pp", "2", "--pp-schedule", "zigzag"], "--pp-schedule must be one of"),
    "pp-microbatches": (2, ["--pp", "2", "--microbatches", "3"], "microbatches"),
    "pp-amp-no-dp": (2, ["--pp", "2", "--dtype", "amp"], "amp"),
    "microbatches-without-pp": (2, ["--tp", "2", "--microbatches", "2"], "need --pp N > 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mesh_flags_one_line(case, cache, tmp_path, capsys, monkeypatch):
    """Refused before any process group exists (a world size from torchrun's variables, no launch needed)."""
    world, args, says = BAD[case]
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    rc = cli.main([*FLAGS, "--batch", "4", "--cache-dir", str(cache), "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("anatomy train: error:") and says in err, err


def test_bad_mesh_flag_exit_code_of_the_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "llm_anatomy.train.cli", *FLAGS, "--tp", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
