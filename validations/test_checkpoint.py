"""Checkpoints you can trust: every kind of damage is caught in one line and the newest intact
checkpoint resumes the uninterrupted loss curve exactly; nothing in a run directory can run code or
lead a resume outside it; one run per directory; --keep prunes only this run's checkpoints; a full
disk and an overflowing lr are one line.

One uninterrupted run (the tiny GQA config, efficient + FusedAdEMAMix, fp32, 12 steps, checkpoints at
4, 8, 12) is damaged in copies; each resume runs steps 9..12 in this process on one thread.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llm_anatomy.train import checkpoint as ckpt
from llm_anatomy.train import cli
from llm_anatomy.train.lock import RunLock
from validations import train_cases

one_thread, cache = train_cases.one_thread, train_cases.cache  # the module fixtures
SHAPE = [*train_cases.SHAPE, "--variant", "efficient", "--dtype", "fp32", "--seed", "3"]
SHARD = "shard-00000-of-00001.safetensors"


def _args(cache: Path, ck: Path, *extra: str, steps: int = 12) -> list[str]:
    return [*SHAPE, "--steps", str(steps), "--eval-every", "4", "--keep", "0", "--cache-dir", str(cache),
            "--ckpt-dir", str(ck), *extra]


def _losses(d: Path) -> list[float]:
    return [s["loss"] for s in json.loads((d / "train_log.json").read_text())["steps"]]


@pytest.fixture(scope="module")
def whole(cache, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("whole") / "run"
    assert cli.main(_args(cache, d)) == 0
    assert sorted(p.name for p in d.glob("step-*")) == ["step-00000004", "step-00000008", "step-00000012"]
    return d


def _copy(whole: Path, tmp: Path) -> Path:
    ck = tmp / "ck"
    shutil.copytree(whole, ck)
    return ck


def _span(shard: Path, pick) -> tuple[int, int]:
    """Byte range of the first tensor whose key satisfies pick (from the safetensors header)."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in sorted(header) if k != "__metadata__" and pick(k))
    a, b = header[key]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _edit(p: Path, fn) -> None:
    p.write_bytes(fn(bytearray(p.read_bytes())))


def _flip_in(pick):
    def damage(step: Path) -> None:
        a, b = _span(step / SHARD, pick)

        def flip(raw):
            raw[(a + b) // 2] ^= 0x08
            return raw
        _edit(step / SHARD, flip)
    return damage


def _replace(name: str, old: bytes, new: bytes):
    def damage(step: Path) -> None:
        raw = (step / name).read_bytes()
        assert old in raw, f"{old!r} not in {name}"
        (step / name).write_bytes(raw.replace(old, new, 1))
    return damage


DAMAGE = {  # id: (damage(step folder), words the one warning line must hold)
    "shard-truncated": (lambda s: _edit(s / SHARD, lambda r: r[:len(r) // 2]), "truncated"),
    "shard-missing": (lambda s: (s / SHARD).unlink(), "missing"),
    "shard-header": (lambda s: _edit(s / SHARD, lambda r: r[:8] + b"PK\x03\x04 not a header" + r[25:]), "sha256"),
    "manifest-missing": (lambda s: (s / "manifest.json").unlink(), "manifest.json is missing"),
    "manifest-truncated": (lambda s: _edit(s / "manifest.json", lambda r: r[:len(r) // 2]), "not valid JSON"),
    "manifest-step-edited": (_replace("manifest.json", b'"step": 12', b'"step": 13'), "its own sha256"),
    "trainer-json-broken": (lambda s: _edit(s / "trainer.json", lambda r: r[:100]), "trainer.json"),
    "trainer-step-20-to-21": (_replace("trainer.json", b'"step": 12', b'"step": 13'), "trainer.json"),
    "weight-bit-flip": (_flip_in(lambda k: k.startswith("model/")), "sha256"),
    "optimizer-bit-flip": (_flip_in(lambda k: k.endswith("/exp_avg_sq")), "sha256"),
    "zeros-4KiB": (lambda s: _edit(s / SHARD, lambda r: r[:len(r) // 2] + bytes(4096) + r[len(r) // 2 + 4096:]),
                   "sha256"),
}


@pytest.mark.parametrize("damage, words", list(DAMAGE.values()), ids=list(DAMAGE))
def test_damaged_checkpoint_is_reported_and_the_newest_intact_one_resumes_the_curve(damage, words, whole, cache,
                                                                                     tmp_path, capsys):
    ck = _copy(whole, tmp_path)
    damage(ckpt.step_dir(ck, 12))
    capsys.readouterr()
    rc = cli.main(_args(cache, ck, "--resume"))
    err = capsys.readouterr().err.strip()
    assert rc == 0, err
    assert len(err.splitlines()) == 1 and err.startswith("anatomy train: warning: checkpoint"), err
    assert "step-00000012" in err and words in err and "resuming from the older step-00000008" in err, err
    log = json.loads((ck / "train_log.json").read_text())
    assert log["start_step"] == 8 and log["resumed_from"] == str(ckpt.step_dir(ck, 8))
    assert _losses(ck) == _losses(whole)  # steps 1..8 from the checkpoint, 9..12 recomputed: bit for bit


def test_no_intact_checkpoint_is_one_line_and_exit_2(whole, cache, tmp_path, capsys):
    ck = _copy(whole, tmp_path)
    for step in (4, 8, 12):
        _flip_in(lambda k: k.startswith("optim/"))(ckpt.step_dir(ck, step))
    before = (ck / "train_log.json").read_bytes()
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no intact checkpoint" in err and "3 damaged" in err, err
    assert (ck / "train_log.json").read_bytes() == before  # nothing ran


class _Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_in_a_checkpoint_never_runs(whole, cache, tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    # a DCP-shaped folder holding only the pickle: not a checkpoint (no manifest), refused, nothing runs
    ck = tmp_path / "evil"
    (ck / "step-00000008").mkdir(parents=True)
    (ck / "step-00000008" / ".metadata").write_bytes(evil)
    (ck / "step-00000008" / "__0_0.distcp").write_bytes(evil)
    (ck / "latest").write_text("step-00000008\n")
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no intact checkpoint" in err and "manifest.json is missing" in err, err
    assert not marker.exists() and not (ck / "train_log.json").exists()
    # the same pickle planted inside an intact checkpoint: never opened, the resume is exact
    ok = _copy(whole, tmp_path)
    (ckpt.step_dir(ok, 12) / ".metadata").write_bytes(evil)
    assert cli.main(_args(cache, ok, "--resume", steps=12)) == 0
    assert not marker.exists()


@pytest.mark.parametrize("pointer", ["../other/step-00000012", "/tmp/step-00000012", "step-00000012/../../other",
                                     "link"])
def test_latest_pointing_outside_the_run_directory_is_refused(pointer, whole, cache, tmp_path, capsys):
    shutil.copytree(whole, tmp_path / "other")
    ck = tmp_path / "ck"
    ck.mkdir()
    if pointer == "link":
        (ck / "latest").symlink_to(tmp_path / "other" / "latest")
    else:
        (ck / "latest").write_text(pointer + "\n")
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused" in err and str(ck / "latest") in err, err
    assert not (ck / "train_log.json").exists() and not list(ck.glob("step-*"))


# ---- one run per directory ----------------------------------------------------------------------------
def test_a_second_run_on_a_locked_directory_is_refused(cache, tmp_path, capsys):
    ck = tmp_path / "ck"
    with RunLock(ck):
        capsys.readouterr()
        assert cli.main(_args(cache, ck, steps=2)) == 2
        err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "in use by another run" in err and f"pid {os.getpid()}" in err, err
    assert not list(ck.glob("step-*")) and not (ck / ".lock").exists()


def test_a_stale_lock_is_taken_over_and_another_hosts_lock_is_not(cache, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid of this host that no longer runs
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".lock").write_text(json.dumps(dict(pid=dead.pid, host=socket.gethostname(), since="then")))
    assert cli.main(_args(cache, ck, steps=2)) == 0
    assert not (ck / ".lock").exists() and ckpt.step_dir(ck, 2).is_dir()
    (ck / ".lock").write_text(json.dumps(dict(pid=1, host="another-host", since="then")))
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume", steps=4)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another-host" in err, err


def test_keep_prunes_only_the_checkpoints_this_run_wrote(whole, cache, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(ckpt.step_dir(whole, 12), ckpt.step_dir(ck, 99))  # another run's
    assert cli.main(_args(cache, ck, "--ckpt-every", "1", "--keep", "1", steps=3)) == 0
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000003", "step-00000099"]


# ---- safe writes --------------------------------------------------------------------------------------
def test_a_full_disk_is_one_line_naming_the_path(cache, tmp_path, capsys, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "_write_new", full)
    ck = tmp_path / "ck"
    capsys.readouterr()
    assert cli.main(_args(cache, ck, steps=4)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "disk holding it is full" in err and str(ck) in err, err
    assert "Traceback" not in err


def test_a_full_disk_for_the_log_is_one_line(cache, tmp_path, capsys, monkeypatch):
    from llm_anatomy.train import report

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(report, "write_atomic", full)
    capsys.readouterr()
    assert cli.main([*SHAPE, "--steps", "2", "--cache-dir", str(cache), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "disk holding it is full" in err and str(tmp_path / "out") in err, err


def test_an_lr_collapsing_the_model_to_the_uniform_law_is_warned(cache, tmp_path, capsys):
    capsys.readouterr()
    # the divergence is chaotic: 6 steps of AdEMAMix at this lr reach the uniform law under either fused CE
    assert cli.main([*SHAPE, "--lr", "1e3", "--optimizer", "ademamix", "--steps", "6", "--cache-dir", str(cache),
                     "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ln(vocab)" in err and "--lr 1000" in err, err
