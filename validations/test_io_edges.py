"""Odd inputs and failing outputs: each ends in one line on stderr and exit code 2, or (a closed pipe)
quietly with coreutils' status 141, never a traceback, and leaves the file system as it was.

Inputs: a FIFO, a link to /dev/zero, a directory, a UNIX socket and a character device (mknod) named
where a file is read. Outputs: /dev/full as standard output, an ENOSPC injected at os.write and an
EROFS/EACCES at the temp file's creation (root bypasses a chmod 0o555 folder; that case runs as a user
only), a closed pipe, special files as targets, concurrent writers and links planted at temp names.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llm_anatomy import io as aio
from llm_anatomy.cli import main
from llm_anatomy.config import ConfigError
from llm_anatomy.entry import PIPE_STATUS
from validations.special_files import (EACCES, ENOSPC, EROFS, KIND_WORDS, KINDS, failing, make_special, mode_of,
                                      without_progress)

REPO = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "32", "--heads", "2", "--layers", "1", "--intermediate", "32", "--vocab", "33", "--batch", "1",
        "--seq", "8"]
TRAIN = [*TINY[:-6], "--vocab", "300", *TINY[-4:], "--steps", "1"]  # a byte-level BPE needs a vocab of 257+
HANG_S = 30  # an alarm, not a timing claim: each call here answers in about a second


def _alarm(*_):
    raise TimeoutError(f"no answer in {HANG_S} s")


def cli(argv, monkeypatch, stdout=None) -> tuple[int, str, str]:
    """main(argv) in this process, cut off by an alarm, stdout a StringIO unless given: (rc, out, err)."""
    import io

    out, err = stdout or io.StringIO(), io.StringIO()
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        sys.stdout, sys.stderr = streams
    return rc, out.getvalue() if hasattr(out, "getvalue") else "", err.getvalue()


def one_line_2(rc, err, *needles):
    err = without_progress(err)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def _claims(folder: Path) -> tuple[Path, Path]:
    """A valid (empty) claims report and a README with its markers, in a folder `anatomy report` takes for a
    checkout (it holds reports/)."""
    (folder / "reports").mkdir(exist_ok=True)
    c = folder / "c.json"
    c.write_text(json.dumps(dict(rows=[], machine={}, date="2026-12-04")))
    readme = folder / "R.md"
    readme.write_text("# r\n<!-- claims-h200:start -->\n<!-- claims-h200:end -->\n")
    return c, readme


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="100")


# ---- special files as inputs --------------------------------------------------------------------
READERS = {  # (argv with {p} for the path, the file's suffix, what the refusal calls it)
    "estimate --gpu": (["estimate", "--gpu", "{p}"], ".json", "gpu profile"),
    "plan --gpu": (["plan", "--gpu", "{p}"], ".json", "gpu profile"),
    "sweep --gpu": (["sweep", "--quiet", "--out", "s.json", "--gpu", "{p}"], ".json", "gpu profile"),
    "estimate --hf-config": (["estimate", "--hf-config", "{p}"], ".json", "Hugging Face config"),
    "report CLAIMS": (["report", "{p}", "--readme", "R.md"], ".json", "claims report"),
    "report --readme": (["report", "c.json", "--readme", "{p}"], ".md", "README"),
    "train --data text": (["train", "--data", "{p}", *TRAIN], ".txt", "training text"),
    "train --data bin": (["train", "--data", "{p}", *TRAIN], ".bin", "token-id file"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS)
def test_special_file_input_is_refused_in_one_line(reader, kind, tmp_path, monkeypatch):
    argv, suffix, what = READERS[reader]
    monkeypatch.chdir(tmp_path)
    _claims(tmp_path)
    p = make_special(kind, "x" + suffix)
    before = mode_of(p)
    rc, out, err = cli([a.format(p=p) for a in argv], monkeypatch)
    if kind == "dir" and reader.startswith(("estimate --hf-config", "train --data")):
        one_line_2(rc, err, str(p))  # a folder is how these take several files: it holds none here
    else:
        one_line_2(rc, err, f"'{p}'", KIND_WORDS[kind], what)
    assert mode_of(p) == before and not out


def test_input_larger_than_its_bound_is_refused(tmp_path, monkeypatch):
    from llm_anatomy.calculator.timing import lookup

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_bytes((lookup.PROFILE_DIR / "h200.json").read_bytes())
    monkeypatch.setattr(lookup, "MAX_PROFILE_BYTES", 1000)
    rc, _, err = cli(["estimate", "--gpu", "p.json"], monkeypatch)
    one_line_2(rc, err, "'p.json'", "over the 1,000-byte bound of a gpu profile")
    with pytest.raises(ConfigError, match="over the 10-byte bound of a thing"):
        aio.read_input(tmp_path / "p.json", "thing", 10)


# ---- standard output that fails -----------------------------------------------------------------
STDOUT_CMDS = {  # every command, each writing to standard output
    "estimate": ["estimate"], "estimate --json": ["estimate", "--json"],
    "estimate --gpu": ["estimate", "--gpu", "H200"], "plan": ["plan", "--gpu", "H200"],
    "plan --json": ["plan", "--gpu", "H200", "--json"], "sweep": ["sweep", "--device", "cpu", "--out", "s.json"],
    "report": ["report", "c.json", "--readme", "R.md"], "help": ["-h"], "version": ["--version"],
    "measure": ["measure", *TINY, "--device", "cpu"], "compare": ["compare", *TINY, "--device", "cpu", "--json"],
    "forensics": ["forensics", *TINY, "--device", "cpu", "--png", "f.png"],
    "train": ["train", *TRAIN, "--json", "--out", "run"], "plan -h": ["plan", "-h"],
}


@pytest.mark.parametrize("cmd", STDOUT_CMDS)
def test_full_stdout_is_one_line_exit_2(cmd, tmp_path, monkeypatch):
    """Standard output on /dev/full, in this process: one line naming standard output and ENOSPC's text."""
    monkeypatch.chdir(tmp_path)
    _claims(tmp_path)
    if cmd == "train":
        pytest.importorskip("tokenizers")
    with open("/dev/full", "w") as full:
        rc, _, err = cli(STDOUT_CMDS[cmd], monkeypatch, stdout=full)
    one_line_2(rc, err, "standard output", os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("cmd", ["estimate", "plan --json", "help", "report"])
def test_full_stdout_in_a_process_leaves_nothing_for_exit(cmd, tmp_path):
    """As a process: no "Exception ignored" from the interpreter's own flush of stdout at exit."""
    _claims(tmp_path)
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "llm_anatomy.cli", *STDOUT_CMDS[cmd]], stdout=full,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(), timeout=120, check=False)
    one_line_2(r.returncode, r.stderr, "standard output", os.strerror(errno.ENOSPC))


PIPE_CMDS = {"plan": ["-m", "llm_anatomy.cli", "plan", "--gpu", "H200"],
             "plan --json": ["-m", "llm_anatomy.cli", "plan", "--gpu", "H200", "--json"],
             "estimate --json": ["-m", "llm_anatomy.cli", "estimate", "--json"],
             "sweep": ["-m", "llm_anatomy.cli", "sweep", "--device", "cpu", "--out", "s.json"],
             "help": ["-m", "llm_anatomy.cli", "-h"],
             "python -m llm_anatomy.sweep": ["-m", "llm_anatomy.sweep", "--device", "cpu", "--out", "s.json"],
             "python -m llm_anatomy.plan_cli": ["-m", "llm_anatomy.plan_cli", "--gpu", "H200"]}


@pytest.mark.parametrize("cmd", PIPE_CMDS)
def test_closed_pipe_ends_quietly_with_141(cmd, tmp_path):
    """A pipe whose reader is gone before the first write: EPIPE every time; no message, status 141."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, *PIPE_CMDS[cmd]], stdout=w, stderr=subprocess.PIPE, text=True,
                           cwd=tmp_path, env=_env(), timeout=120, check=False)
    finally:
        os.close(w)
    assert (p.returncode, without_progress(p.stderr)) == (PIPE_STATUS, "")


def test_plan_into_head_20_times_never_a_traceback(tmp_path):
    """`anatomy plan | head -1`, 20 runs at once: head closes early; each ends 0 (all written before it
    closed) or quietly with 141, and stderr stays empty."""
    line = f"{sys.executable} -m llm_anatomy.cli plan --gpu H200 | head -1; echo \"rc=${{PIPESTATUS[0]}}\" >&2"
    procs = [subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=_env()) for _ in range(20)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert out.startswith("plan: ") and len(out.splitlines()) == 1
        assert err.strip() in ("rc=0", f"rc={PIPE_STATUS}"), err


# ---- files written: failures, special targets, races, planted links --------------------------------
def _listing(folder: Path) -> dict:
    return {p.name: p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink()
            else None for p in folder.iterdir()}


@pytest.mark.parametrize("where, err", [("write", ENOSPC), ("mkstemp", EROFS), ("mkstemp", EACCES)])
def test_write_atomic_failure_is_one_line_target_unchanged_no_temp(where, err, tmp_path, monkeypatch):
    target = tmp_path / "t.json"
    target.write_text("old")
    before = _listing(tmp_path)
    with failing(monkeypatch, where, err, "t.json"), pytest.raises(aio.OutputError) as e:
        aio.write_atomic(target, "new" * 1000)
    assert str(e.value) == f"cannot write {target}: {os.strerror(err)}"
    assert _listing(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder: the injected cases stand for it")
def test_write_atomic_into_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(aio.OutputError, match=os.strerror(EACCES)):
            aio.write_atomic(ro / "t.json", "x")
        assert not list(ro.iterdir())
    finally:
        ro.chmod(0o755)


FILE_WRITERS = {  # a command's file outputs, each aimed at tmp_path/<name>
    "sweep --out": (["sweep", "--quiet", "--out", "{p}"], "s.json"),
    "forensics --png": (["forensics", *TINY, "--device", "cpu", "--png", "{p}"], "f.png"),
    "forensics --out": (["forensics", *TINY, "--device", "cpu", "--out", "{p}"], "f.json"),
    "forensics --snapshot": (["forensics", *TINY, "--device", "cpu", "--png", "g.png", "--snapshot", "{p}"], "f.pkl"),
    "report --readme": (["report", "c.json", "--readme", "{p}"], "W.md"),
}


@pytest.mark.parametrize("fail", [("write", ENOSPC), ("mkstemp", EROFS)])
@pytest.mark.parametrize("writer", FILE_WRITERS)
def test_command_whose_file_write_fails_is_one_line(writer, fail, tmp_path, monkeypatch):
    argv, name = FILE_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    _claims(tmp_path)
    (tmp_path / "W.md").write_bytes((tmp_path / "R.md").read_bytes())
    before = _listing(tmp_path)
    call, err = fail
    with failing(monkeypatch, call, err, name):
        rc, _, e = cli([a.format(p=name) for a in argv], monkeypatch)
    one_line_2(rc, e, f"cannot write {name}", os.strerror(err))
    after = _listing(tmp_path)
    assert after.get(name) == before.get(name) and not [n for n in after if n.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["chardev", "fifo", "socket", "dir", "zero-link"])
@pytest.mark.parametrize("writer", FILE_WRITERS)
def test_special_target_is_refused_and_left_as_it_was(writer, kind, tmp_path, monkeypatch):
    argv, name = FILE_WRITERS[writer]
    monkeypatch.chdir(tmp_path)
    _claims(tmp_path)
    p = make_special(kind, name)
    before = mode_of(p)
    rc, _, err = cli([a.format(p=p) for a in argv], monkeypatch)
    if writer == "report --readme":  # read before it is written: refused as an input
        one_line_2(rc, err, f"'{name}'", KIND_WORDS[kind], "README")
    else:
        one_line_2(rc, err, f"'{name}'", KIND_WORDS[kind], "must be a regular file or a new path")
    assert mode_of(p) == before and not stat.S_ISREG(os.lstat(p).st_mode)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_write_atomic_never_replaces_a_device_it_was_handed(tmp_path):
    dev = make_special("chardev", tmp_path / "null")
    with pytest.raises(ConfigError, match="character device"):
        aio.write_atomic(dev, "x")
    assert stat.S_ISCHR(os.stat(dev).st_mode) and os.listdir(tmp_path) == ["null"]


def _snapshot_file(tmp_path: Path) -> Path:
    from validations.test_sweep_forensics import _synthetic_snapshot

    f = tmp_path / "snap.pkl"
    f.write_bytes(pickle.dumps(_synthetic_snapshot()[0]))
    return f


def test_six_concurrent_forensics_writers_of_one_png(tmp_path):
    """Six processes write the same --png through forensics' writer (plot_timeline) at once: all succeed,
    the PNG is whole, and no temp file is left."""
    from PIL import Image

    snap = _snapshot_file(tmp_path)
    code = ("import pickle, sys; from llm_anatomy.measure.forensics import plot_timeline, replay; "
            "plot_timeline(replay(pickle.loads(open(sys.argv[1], 'rb').read())), sys.argv[2], 'x')")
    png = tmp_path / "out" / "f.png"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(snap), str(png)], stderr=subprocess.PIPE, text=True,
                              env=_env()) for _ in range(6)]
    errs = [(p.communicate(timeout=300)[1], p.returncode) for p in procs]
    assert all(rc == 0 and not e for e, rc in errs), errs
    with Image.open(png) as im:
        im.verify()
    assert os.listdir(png.parent) == ["f.png"]


def test_a_link_planted_at_a_temp_name_is_not_followed(tmp_path, monkeypatch):
    """Links at forensics' former fixed temp name and at write_atomic's next candidate names: none is
    followed, their target is untouched, and the PNG is written."""
    from llm_anatomy.measure.forensics import plot_timeline, replay
    from validations.test_sweep_forensics import _synthetic_snapshot

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    png = tmp_path / "f.png"
    os.symlink(victim, tmp_path / "f.tmp.png")
    names = iter(["planted", "fresh"])
    os.symlink(victim, tmp_path / ".f.png.planted.tmp")
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    plot_timeline(replay(_synthetic_snapshot()[0]), png, "x")
    assert victim.read_bytes() == b"keep" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.readlink(tmp_path / "f.tmp.png") == str(victim)
    assert os.readlink(tmp_path / ".f.png.planted.tmp") == str(victim)
    assert sorted(os.listdir(tmp_path)) == [".f.png.planted.tmp", "f.png", "f.tmp.png", "victim"]


def test_write_atomic_keeps_the_replaced_files_mode(tmp_path):
    t = tmp_path / "t"
    t.write_text("a")
    t.chmod(0o640)
    aio.write_atomic(t, "b")
    assert stat.S_IMODE(t.stat().st_mode) == 0o640 and t.read_text() == "b"


def test_write_atomic_gives_a_new_file_the_umasks_mode(tmp_path):
    old = os.umask(0o027)
    try:
        aio.write_atomic(tmp_path / "n", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "n").stat().st_mode) == 0o640  # not mkstemp's 0600


# ---- small refusals -----------------------------------------------------------------------------
def test_calibrate_usage_error_is_one_line(monkeypatch):
    rc, _, err = cli(["calibrate", "--no-such-flag"], monkeypatch)
    one_line_2(rc, err, "anatomy calibrate: error:", "--no-such-flag")


def _hf(tmp_path, **fields) -> Path:
    from validations.test_fuzz import HF_BASE

    d = {**HF_BASE, **fields}
    for k in [k for k, v in fields.items() if v is _ABSENT]:
        d.pop(k)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    return p


_ABSENT = object()


def test_zero_kv_heads_names_the_config_once(tmp_path, monkeypatch):
    p = _hf(tmp_path, num_key_value_heads=0)
    rc, _, err = cli(["estimate", "--hf-config", str(p)], monkeypatch)
    one_line_2(rc, err, "num_key_value_heads must be a positive integer")
    assert err.count(str(p)) == 1, err


@pytest.mark.parametrize("act", ["", None, "gelu", "relu"])
def test_an_activation_the_models_lack_is_refused(act, tmp_path, monkeypatch):
    rc, _, err = cli(["estimate", "--hf-config", str(_hf(tmp_path, hidden_act=act))], monkeypatch)
    one_line_2(rc, err, "hidden_act", "is not modelled")


@pytest.mark.parametrize("act", ["silu", "swish", _ABSENT])
def test_silu_or_no_activation_is_read_as_silu(act, tmp_path, monkeypatch):
    rc, _, err = cli(["estimate", "--hf-config", str(_hf(tmp_path, hidden_act=act)), "--json"], monkeypatch)
    assert rc == 0 and "hidden_act" not in err and all(" note: " in ln for ln in err.splitlines())


def test_quantization_config_is_noted_on_stderr(tmp_path, monkeypatch):
    q = dict(quant_method="bitsandbytes", load_in_4bit=True)
    rc, out, err = cli(["estimate", "--hf-config", str(_hf(tmp_path, quantization_config=q)), "--json"], monkeypatch)
    plain = json.loads(cli(["estimate", "--hf-config", str(_hf(tmp_path)), "--json"], monkeypatch)[1])
    assert rc == 0 and all(" note: " in ln for ln in err.splitlines())
    assert sum("note: quantization_config ignored" in ln for ln in err.splitlines()) == 1
    assert json.loads(out)["params"] == plain["params"]

