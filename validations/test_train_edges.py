"""Training at its edges: a full disk anywhere (the run lock, the tokenizer cache, a checkpoint) is one line naming
the path and the errno, exit 2, the last good checkpoint untouched and no temp folder left; a checkpoint written
by another run (here: another --lr) is refused in one line listing the differences, unless --allow-changed says
the change is deliberate; step folders that are links or plain files are named as they are skipped; a crafted
shard header, with the manifest re-signed to match, is caught before safetensors reads it.

Tiny runs of the two-layer model (4 steps, a checkpoint every 2), on one thread."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from llm_anatomy.train import checkpoint as ckpt
from llm_anatomy.train import cli, identity, lock, report, shard_header, tokenizer
from llm_anatomy.train import manifest as mf
from validations import train_cases

one_thread, cache = train_cases.one_thread, train_cases.cache  # the module fixtures
SHARD = "shard-00000-of-00001.safetensors"


def _args(cache: Path, ck: Path, *extra: str, steps: int = 4) -> list[str]:
    return [*train_cases.SHAPE, "--steps", str(steps), "--eval-every", "2", "--keep", "0", "--cache-dir", str(cache),
            "--ckpt-dir", str(ck), *extra]


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _enospc(path="") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def two_steps(cache, tmp_path_factory) -> Path:
    """A run directory holding step-00000002, written at --lr 1e-3."""
    d = tmp_path_factory.mktemp("two") / "run"
    assert cli.main(_args(cache, d, steps=2)) == 0
    return d


def _copy(src: Path, tmp: Path) -> Path:
    ck = tmp / "ck"
    shutil.copytree(src, ck)
    return ck


# ---- a full disk --------------------------------------------------------------------------------------
def test_a_full_disk_at_the_run_lock_is_one_line_and_leaves_no_lock(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lock.os, "pwrite", lambda fd, data, at: (_ for _ in ()).throw(_enospc()))
    ck = tmp_path / "ck"
    capsys.readouterr()
    assert cli.main(_args(cache, ck)) == 2
    err = _err(capsys)
    assert len(err) == 1 and str(ck / ".lock") in err[0] and "[ENOSPC]" in err[0] and "full" in err[0], err
    assert list(ck.iterdir()) == []


@pytest.mark.parametrize("where", ["tokens.bin", "tokenizer.json"])
def test_a_full_disk_in_the_tokenizer_cache_is_one_line_and_leaves_no_temp_folder(where, tmp_path, capsys,
                                                                                     monkeypatch):
    if where == "tokens.bin":
        def encode(tok, docs, out, dtype, batch=256):
            out.write_bytes(b"\0" * 64)
            raise _enospc()
        monkeypatch.setattr(tokenizer, "_encode_to", encode)
    else:
        real = Path.write_text

        def write_text(self, *a, **kw):
            if self.name == "tokenizer.json":
                raise _enospc(self)
            return real(self, *a, **kw)
        monkeypatch.setattr(Path, "write_text", write_text)
    fresh = tmp_path / "cache"
    capsys.readouterr()
    assert cli.main(_args(fresh, tmp_path / "ck")) == 2
    err = _err(capsys)
    assert len(err) == 1 and f"the tokenizer cache {fresh}" in err[0] and "[ENOSPC]" in err[0], err
    assert "Exception" not in err[0] and list(fresh.iterdir()) == []  # no .tmp-bpe-* left, no entry


def test_a_full_disk_during_a_save_names_the_checkpoint_and_keeps_the_last_good_one(two_steps, cache, tmp_path,
                                                                                      capsys, monkeypatch):
    ck = _copy(two_steps, tmp_path)
    good = _digests(ckpt.step_dir(ck, 2))

    def full(path, data):
        raise _enospc(path)

    monkeypatch.setattr(ckpt, "_write_new", full)
    monkeypatch.setattr(report, "write_atomic", full)  # the disk stays full for the log written after
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume")) == 2
    err = _err(capsys)
    assert len(err) == 1 and f"checkpoint {ckpt.step_dir(ck, 4)}" in err[0] and "[ENOSPC]" in err[0], err
    assert "log" not in err[0], err  # the save's own failure, not the log's after it
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith((".tmp", ".old", "step-"))) == ["step-00000002"]
    assert _digests(ckpt.step_dir(ck, 2)) == good and (ck / "latest").read_text() == "step-00000002\n"


# ---- a checkpoint of another run ----------------------------------------------------------------------
def test_the_identity_holds_every_hyperparameter_of_the_trajectory(two_steps):
    ident = json.loads((ckpt.step_dir(two_steps, 2) / "trainer.json").read_text())["identity"]
    assert set(ident) == set(identity.KEYS)
    assert ident["lr"] == 1e-3 and ident["schedule"] == "cosine" and ident["grad_clip"] == 1.0
    assert ident["optimizer_hparams"]["betas"] == [0.9, 0.999] and "eps" in ident["optimizer_hparams"]
    assert ident["run"]["batch"] == 4 and ident["config"]["hidden"] == 64


def test_a_step_folder_from_a_run_with_another_lr_is_refused_unless_allowed(two_steps, cache, tmp_path, capsys):
    ck = tmp_path / "other"
    ck.mkdir()
    shutil.copytree(ckpt.step_dir(two_steps, 2), ckpt.step_dir(ck, 2))  # the folder alone, no `latest`
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume", "--lr", "2e-3")) == 2
    err = _err(capsys)
    assert len(err) == 1 and "written by another run" in err[0] and "lr 0.001 -> 0.002" in err[0], err
    assert "--allow-changed lr" in err[0], err
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002"]  # nothing trained, nothing written

    assert cli.main(_args(cache, ck, "--resume", "--lr", "2e-3", "--allow-changed", "lr")) == 0
    err = _err(capsys)
    assert len(err) == 1 and "lr changed from 0.001 to 0.002" in err[0], err
    log = json.loads((ck / "train_log.json").read_text())
    assert log["start_step"] == 2 and log["changed_on_resume"] == [dict(key="lr", checkpoint=1e-3, now=2e-3)]
    assert json.loads((ckpt.step_dir(ck, 4) / "trainer.json").read_text())["identity"]["lr"] == 2e-3


def test_allow_changed_names_only_parts_of_the_identity(cache, tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(_args(cache, tmp_path / "ck", "--allow-changed", "lr,colour")) == 2
    err = _err(capsys)
    assert len(err) == 1 and "--allow-changed colour" in err[0] and "weight_decay" in err[0], err


def test_step_folders_that_are_links_or_plain_files_are_named_as_they_are_skipped(two_steps, cache, tmp_path,
                                                                                  capsys):
    ck = _copy(two_steps, tmp_path)
    (ck / "latest").unlink()
    elsewhere = _copy(two_steps, tmp_path / "elsewhere")
    ckpt.step_dir(ck, 4).symlink_to(ckpt.step_dir(elsewhere, 2), target_is_directory=True)
    ckpt.step_dir(ck, 3).write_text("not a checkpoint")
    target = _digests(ckpt.step_dir(elsewhere, 2))
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume", "--keep", "0")) == 0
    err = _err(capsys)
    assert len(err) == 2, err
    assert "step-00000004" in err[0] and "symbolic link" in err[0] and "resuming from the older step-00000002" in err[0]
    assert "step-00000003" in err[1] and "plain file" in err[1], err
    assert json.loads((ck / "train_log.json").read_text())["start_step"] == 2
    assert _digests(ckpt.step_dir(elsewhere, 2)) == target  # the link's target is never written


# ---- a crafted shard header ---------------------------------------------------------------------------
def _split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _tensors(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _out_of_range(raw):
    h, data = _split(raw)
    last = h[_tensors(h)[-1]]
    last["data_offsets"] = [o + 4096 for o in last["data_offsets"]]
    return _join(h, data)


def _overlapping(raw):
    h, data = _split(raw)
    second = h[_tensors(h)[1]]
    second["data_offsets"] = [o - 4 for o in second["data_offsets"]]
    return _join(h, data)


def _shape_mismatch(raw):
    h, data = _split(raw)
    t = h[next(k for k in _tensors(h) if k.startswith("model/"))]
    t["shape"] = t["shape"][:-1] + [t["shape"][-1] + 1]
    return _join(h, data)


def _absurd_length(raw):
    return (2**62).to_bytes(8, "little") + raw[8:]


CRAFTED = {"offsets-out-of-range": (_out_of_range, "out of range"), "overlapping": (_overlapping, "overlaps"),
           "dtype-shape-vs-bytes": (_shape_mismatch, "its offsets span"),
           "absurd-header-length": (_absurd_length, "header length")}


def _craft_and_resign(step: Path, craft) -> None:
    """Rewrite the shard through `craft` and re-sign the manifest so that every size and sha256 matches."""
    (step / SHARD).write_bytes(craft((step / SHARD).read_bytes()))
    m = json.loads((step / mf.MANIFEST).read_text())
    files = {name: (hashlib.sha256((step / name).read_bytes()).hexdigest(), (step / name).stat().st_size)
             for name in m["files"]}
    (step / mf.MANIFEST).write_text(mf.manifest_text(m["step"], m["world"], files))
    mf.read_manifest(step)  # the manifest vouches for the crafted shard


@pytest.mark.parametrize("craft, words", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_crafted_shard_header_is_one_line_and_the_older_checkpoint_resumes(craft, words, two_steps, cache,
                                                                              tmp_path, capsys):
    ck = _copy(two_steps, tmp_path)
    assert cli.main(_args(cache, ck, "--resume")) == 0  # step-00000004 beside step-00000002
    _craft_and_resign(ckpt.step_dir(ck, 4), craft)
    with pytest.raises(shard_header.BadHeader, match=words):
        shard_header.check_file(ckpt.step_dir(ck, 4) / SHARD)
    capsys.readouterr()
    assert cli.main(_args(cache, ck, "--resume", steps=5)) == 0
    err = _err(capsys)
    assert len(err) == 1 and "step-00000004" in err[0] and "not a valid safetensors file" in err[0], err
    assert words in err[0] and "resuming from the older step-00000002" in err[0], err
    assert json.loads((ck / "train_log.json").read_text())["start_step"] == 2

    _craft_and_resign(ckpt.step_dir(ck, 2), craft)  # no intact checkpoint left: one line, exit 2
    for step in (4, 5):
        shutil.rmtree(ckpt.step_dir(ck, step))
    (ck / "latest").unlink()
    assert cli.main(_args(cache, ck, "--resume", steps=5)) == 2
    err = _err(capsys)
    assert len(err) == 1 and "no intact checkpoint" in err[0] and words in err[0], err
