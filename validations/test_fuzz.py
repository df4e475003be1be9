"""Fuzzing the inputs: random `anatomy` argument lists, mutated config.json files and mutated GPU profiles.

Every call runs `llm_anatomy.cli.main(argv)` in this process and must end with exit code 0 or 2; on 2,
exactly one line on stderr; never a traceback; on 0, no non-finite number in what it printed; and no
call may hang (each is cut off by an alarm, far above what the sizes drawn cost). Sizes are drawn so
that a valid draw is cheap: the estimate's cost grows with the layer count, measure, compare and
forensics build the model, so their valid values stay tiny, while their invalid and out-of-range
values are as wild as a user's. FUZZ_SCALE multiplies every example count (the ci profile runs
FUZZ_SCALE=1; a one-off larger run: FUZZ_SCALE=20).
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import signal
import traceback
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llm_anatomy.cli import main
from llm_anatomy.entry import PIPE_STATUS
from validations.special_files import KINDS, make_special, without_progress

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
HANG_S = 60  # an alarm, not a timing claim: a valid draw here costs well under a second
COUNTS: Counter = Counter()
# a printed non-finite number; not a word, and not a file the user named so (`--out nan` prints nan.json)
NONFINITE = re.compile(r"(?<![A-Za-z_/])(nan|inf|infinity)(?![A-Za-z_]|\.[A-Za-z])", re.IGNORECASE)


def _examples(n: int, **kw):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, **kw,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang(f"no answer in {HANG_S} s")


# special files the flags below name, made in the scratch folder: read or written, each must be refused
SPECIAL = {f"{kind}.{ext}": kind for kind in KINDS for ext in ("json", "png", "md")}


@pytest.fixture(scope="module", autouse=True)
def _in_a_scratch_folder(tmp_path_factory):
    """Every file a command writes (sweep reports, forensics plots, README) lands in a scratch folder, beside
    the special files (a kind mknod may not make here is left out: its name is then a missing file)."""
    old = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("fuzz"))
    for name, kind in SPECIAL.items():
        with contextlib.suppress(pytest.skip.Exception):
            make_special(kind, name)
    yield
    os.chdir(old)
    print("\nfuzz calls: " + ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items())))


def run_cli(argv: list[str], kind: str, out: io.StringIO | None = None) -> tuple[int, str, str]:
    """main(argv) in this process; asserts the contract and returns (exit code, stdout, stderr). `out`:
    standard output (a StringIO by default); a closed pipe there may end the call quietly with 141."""
    COUNTS[kind] += 1
    out, err = out or io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse: --help, --version, usage errors
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        pytest.fail(f"hang: anatomy {argv!r}")
    except BaseException:  # noqa: BLE001 - a traceback is the failure this test looks for
        pytest.fail(f"traceback from anatomy {argv!r}:\n{traceback.format_exc()}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    o, e = out.getvalue(), without_progress(err.getvalue())
    if rc == PIPE_STATUS and getattr(out, "errno", None) == errno.EPIPE:
        assert e == "", (argv, e)  # a closed pipe ends quietly
        return rc, o, e
    assert rc in (0, 2), (argv, rc, e)
    assert "Traceback" not in e, (argv, e)
    if rc == 2:
        assert len(e.strip().splitlines()) == 1, (argv, e)
    else:
        assert not NONFINITE.search(o), (argv, o)
        if "--json" in argv and argv[0] in ("estimate", "measure", "compare"):
            json.loads(o, parse_constant=lambda c: pytest.fail(f"{c} in the JSON of {argv!r}"))
    return rc, o, e


# ---- values a user might type --------------------------------------------------------------------
WILD = st.sampled_from(["", " ", "0", "-1", "-0", "1e23", "10" * 40, str(10**30), str(2**63), "nan", "inf", "-inf",
                        "1.5", "0x10", "1_000", "abc", "--", "-", "\x00", "\u202e7", "é", "[bold]x[/]", "\n2",
                        "4097", str(2**24 + 1), str(2**25)])
INT_SMALL = st.integers(1, 8).map(str)


def _text():
    return st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


def _value(cheap):
    """A flag's value: mostly cheap valid ones, or wild ones."""
    return st.one_of(cheap, WILD, _text())


MODEL_FLAGS = {
    "--hidden": st.sampled_from(["32", "64", "128"]), "--heads": st.sampled_from(["2", "4", "8"]),
    "--kv-heads": st.sampled_from(["1", "2", "4"]), "--layers": st.sampled_from(["1", "2", "3"]),
    "--intermediate": st.sampled_from(["32", "96", "100"]), "--vocab": st.sampled_from(["33", "128", "1000"]),
    "--batch": st.sampled_from(["1", "2"]), "--seq": st.sampled_from(["4", "8", "16"]),
    "--dtype": st.sampled_from(["amp", "bf16", "fp32"]), "--variant": st.sampled_from(["baseline", "efficient"]),
    "--recompute": st.sampled_from(["none", "mlp", "full"]), "--mlp": st.sampled_from(["swiglu", "gpt-oss"]),
}
# estimate is arithmetic: every width may be huge, only the layer count sets its cost
ESTIMATE_FLAGS = {
    **MODEL_FLAGS,
    "--hidden": st.sampled_from(["64", "512", "4096", "16384", str(2**24)]),
    "--intermediate": st.sampled_from(["96", "11008", "65536", str(2**24)]),
    "--vocab": st.sampled_from(["128", "32000", "128256", str(2**24)]),
    "--batch": st.sampled_from(["1", "16", "1024", str(2**24)]), "--seq": st.sampled_from(["1", "4096", str(2**20)]),
    "--layers": st.sampled_from(["1", "2", "32", "80"]),
    "--preset": st.sampled_from(["seed", "llama3-8b", "mistral-7b", "llama3.2-1b", "nope"]),
    "--world-size": st.sampled_from(["1", "2", "8", "1024"]), "--strategy": st.sampled_from(["ddp", "fsdp"]),
    "--gpu": st.sampled_from(["H200", "H100", "A100-80GB", "A100", "H100 SXM", "b200", "RTX4090", "h200-measured",
                              "Z9000", "x.json", *SPECIAL]),
    "--hf-config": st.sampled_from([n for n in SPECIAL if n.endswith(".json")]),
    "--device": st.sampled_from(["cpu", "cuda"]),
}
SWEEP_FLAGS = {
    "--preset": st.sampled_from(["seed", "seed,llama3.2-1b", "tinyllama-1.1b", "nope", ",", "seed,,seed"]),
    "--hidden": st.sampled_from(["512", "1024,2048", "500", "64"]), "--layers": st.sampled_from(["1", "2,4", "3"]),
    "--batch": st.sampled_from(["1", "1,16", str(2**24)]), "--seq": st.sampled_from(["16", "128,4096"]),
    "--dtype": st.sampled_from(["amp", "bf16,fp32", "fp16"]), "--variant": st.sampled_from(["baseline", "efficient"]),
    "--mem-limit": st.sampled_from(["1", "0.5", "1e9", "inf", "nan", "-1", "1e400"]),
    "--out": st.sampled_from(["s.json", "d/s.json", ".", "", *SPECIAL]), "--device": st.sampled_from(["cpu", "auto"]),
    "--gpu": st.sampled_from(["H200", *SPECIAL]),
}
FORENSICS_FLAGS = {**MODEL_FLAGS, "--top": st.sampled_from(["1", "3", "0", "-1"]),
                   "--optimizer": st.sampled_from(["adamw", "ademamix", "none"]),
                   "--peak-phase": st.sampled_from(["forward", "backward", "optimizer"]),
                   "--device": st.just("cpu"), "--png": st.sampled_from(["f.png", "f/g.png", *SPECIAL]),
                   "--out": st.sampled_from([n for n in SPECIAL if n.endswith(".json")]),
                   "--snapshot": st.sampled_from(list(SPECIAL))}
TINY = ["--hidden", "32", "--heads", "2", "--layers", "1", "--intermediate", "32", "--vocab", "33", "--batch", "1",
        "--seq", "4"]


@st.composite
def argv_for(draw, cmd: str, flags: dict, base: list[str] = (), wild: int = 2):
    """`cmd`, then `base`, then a few flags: each with a cheap valid value, and at most `wild` of them wild."""
    names = draw(st.lists(st.sampled_from(sorted(flags)), max_size=5, unique=True))
    argv, n_wild = [cmd, *base], 0
    for name in names:
        if n_wild < wild and draw(st.booleans()):
            argv += [name, draw(st.one_of(WILD, _text()))]
            n_wild += 1
        else:
            argv += [name, draw(flags[name])]
    if draw(st.integers(0, 9)) == 0:  # now and then a flag nobody defined, or one without its value
        argv.insert(draw(st.integers(1, len(argv))), draw(st.sampled_from(["--no-such", "--batch", "-x", "--json"])))
    if cmd != "sweep" and draw(st.booleans()):
        argv.append("--json")
    return argv


@_examples(300)
@given(argv_for("estimate", ESTIMATE_FLAGS))
def test_fuzz_estimate_flags(argv):
    run_cli(argv, "estimate")


@_examples(30)
@given(st.sampled_from(["measure", "compare"]).flatmap(
    lambda c: argv_for(c, {k: v for k, v in MODEL_FLAGS.items() if k not in ("--batch", "--seq")} |
                       {"--device": st.just("cpu")}, TINY, wild=1)))
def test_fuzz_measure_and_compare_flags(argv):
    """Valid draws build a tiny model; wild values must be refused before anything is allocated."""
    run_cli(argv, "measure/compare")


@_examples(60)
@given(argv_for("sweep", SWEEP_FLAGS, ["--quiet"]))
def test_fuzz_sweep_flags(argv):
    run_cli(argv, "sweep")


@_examples(6)
@given(argv_for("forensics", FORENSICS_FLAGS, [*TINY, "--device", "cpu"], wild=1))
def test_fuzz_forensics_flags(argv):
    run_cli(argv, "forensics")


@_examples(40)
@given(st.lists(st.one_of(st.sampled_from(["--readme", "--marker", "nope.json", "README.md", "-h", "--x", *SPECIAL]),
                          WILD, _text()), max_size=4))
def test_fuzz_report_and_top_level_flags(rest):
    """report reads only files that are not there (its malformed-file fuzzing is the report's own), and the
    top level parses whatever comes first."""
    run_cli(["report", *rest], "report")
    if rest and rest[0] not in ("report", "train", "sweep", "forensics", "calibrate"):
        run_cli(rest, "top level")


# ---- standard output that fails part-way -----------------------------------------------------------
class FailingOut(io.StringIO):
    """Standard output that takes `room` characters, then fails every write with OSError(errno)."""

    def __init__(self, room: int, err: int):
        super().__init__()
        self.room, self.errno = room, err

    def write(self, text):
        if self.tell() + len(text) > self.room:
            raise OSError(self.errno, os.strerror(self.errno))
        return super().write(text)


@_examples(60)
@given(argv=st.one_of(argv_for("estimate", ESTIMATE_FLAGS, wild=1), argv_for("sweep", SWEEP_FLAGS, ["--device", "cpu"], wild=1),
                      st.sampled_from([["plan", "--gpu", "H200"], ["plan", "--json"], ["-h"], ["estimate", "-h"]])),
       room=st.sampled_from([0, 1, 100, 4000]), err=st.sampled_from([errno.ENOSPC, errno.EPIPE, errno.EIO]))
def test_fuzz_failing_stdout(argv, room, err):
    """Whatever the command, output that fails is one line and exit 2 (a closed pipe: quiet, 141), or the
    output fit in the room given and the call ended as it would have."""
    rc, out, e = run_cli(argv, "failing stdout", FailingOut(room, err))
    if rc == 2 and "standard output" in e:
        assert os.strerror(err) in e, (argv, e)


# ---- config.json mutations -----------------------------------------------------------------------
HF_BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", hidden_size=2048,
               num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=True, attention_bias=False, mlp_bias=False, max_position_embeddings=131072,
               rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                 original_max_position_embeddings=8192, rope_type="llama3"),
               _name_or_path="meta-llama/Llama-3.2-1B")
HF_KEYS = [*HF_BASE, "sliding_window", "rope_parameters", "partial_rotary_factor", "model_type"]
NUMBERS = st.sampled_from([0, -1, 1, 2, 3, 7, 64, 4097, 2**24 + 1, 10**30, 2**63, 0.5, 1e-9, -0.0, 1e308,
                           float("nan"), float("inf"), float("-inf"), True, False])
JSON_LEAF = st.one_of(st.none(), NUMBERS, st.integers(-5, 100), st.text(max_size=8),
                      st.sampled_from(["false", "true", "silu", "gelu", "llama3", "default", "4096"]))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.sampled_from(HF_KEYS), inner,
                                                                             max_size=3)), max_leaves=6)


DEEP = "__deep__"  # a placeholder: the nesting is spliced into the bytes (json itself could not build it)


def _splice_deep(raw: bytes, depth: int) -> bytes:
    return raw.replace(json.dumps(DEEP).encode(), b"[" * depth + b"]" * depth)


@st.composite
def mutated(draw, base: dict, keys: list[str]) -> bytes:
    """`base` as JSON bytes after a few mutations: a field deleted, retyped or set to a wild number, a
    nested value, a whole-file wrap in deep nesting, raw bytes that are not UTF-8, or a cut-off file."""
    d = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["delete", "set", "set", "deep", "nested"]))
        key = draw(st.sampled_from(keys))
        if how == "delete":
            d.pop(key, None)
        elif how == "set":
            d[key] = draw(JSON_VALUE)
        elif how == "deep":
            d[key] = DEEP
        else:  # a nested block mutated one level down
            sub = d.get(key) if isinstance(d.get(key), dict) else {}
            d[key] = {**sub, draw(st.sampled_from(["rope_type", "type", "factor", "rope_theta"])): draw(JSON_VALUE)}
    raw = _splice_deep(json.dumps(d).encode(), draw(st.sampled_from([50, 500, 5000])))  # NaN, Infinity as JSON's
    tail = draw(st.sampled_from(["none", "none", "latin1", "cut", "wrap", "bom"]))
    if tail == "latin1":
        raw = raw.replace(b'"llama"', b'"ll\xe9ama"').replace(b"}", b"\xff}", 1)
    elif tail == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif tail == "wrap":
        raw = b"[" * 3000 + raw + b"]" * 3000
    elif tail == "bom":
        raw = b"\xef\xbb\xbf" + raw
    return raw


@_examples(150)
@given(raw=mutated(HF_BASE, HF_KEYS), extra=st.sampled_from([[], ["--seq", "8192"], ["--gpu", "H200"], ["--layers", "2"]]))
def test_fuzz_hf_config(raw, extra, tmp_path_factory):
    p = tmp_path_factory.mktemp("hf") / "config.json"
    p.write_bytes(raw)
    rc, out, _ = run_cli(["estimate", "--hf-config", str(p), "--batch", "1", "--seq", "1024", *extra, "--json"],
                           "config.json")
    if rc == 0:
        cfg = json.loads(out)["config"]
        assert isinstance(cfg["tie_embeddings"], bool) and math.isfinite(cfg["rope_theta"])


# ---- GPU profile mutations: exit 2 and one line expected of the profile loader -----------------------
# The loader is the timing model's (llm_anatomy/calculator/gpus.py, llm_anatomy/calculator/timing/profile.py): this
# test states the contract a strict loader keeps, and fails where a mutated profile gives a traceback or a NaN.
PROFILE = json.loads((Path(__file__).parents[1] / "llm_anatomy/calculator/profiles/h200.json").read_text())


def _paths(d, prefix=()):
    """Every path into the profile's nested dicts and lists."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


PROFILE_PATHS = [p for p in _paths(PROFILE) if len(p) <= 4]


class Blob(bytes):
    """Bytes that show as the mutations that made them (a profile is 54 kB: too long for a failure message)."""

    how: list

    def __repr__(self):
        return f"<profile.json after {self.how}>"


@st.composite
def mutated_profile(draw) -> Blob:
    d, how = json.loads(json.dumps(PROFILE)), []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PROFILE_PATHS))
        node = d
        try:
            for k in path[:-1]:
                node = node[k]
            if draw(st.integers(0, 2)) == 0 and isinstance(node, dict):
                node.pop(path[-1], None)
                how.append(f"del {'.'.join(map(str, path))}")
            else:
                node[path[-1]] = v = draw(st.one_of(JSON_VALUE, st.just(DEEP), st.just("h200.json")))
                how.append(f"{'.'.join(map(str, path))} = {str(v)[:60]}")
        except (KeyError, IndexError, TypeError):  # an earlier mutation changed the shape
            pass
    raw = json.dumps(d).encode()
    tail = draw(st.sampled_from(["none", "none", "none", "latin1", "cut", "self"]))
    if tail == "latin1":
        raw = raw.replace(b"}", b"\xff}", 1)
    elif tail == "cut":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif tail == "self":  # a profile whose base is itself
        raw = json.dumps({**d, "base": "profile.json"}).encode()
    blob = Blob(_splice_deep(raw, 2000))
    blob.how = [*how, tail]
    return blob


@_examples(15, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking; each loads and fits 54 kB
@given(raw=mutated_profile())
def test_fuzz_gpu_profile(raw, tmp_path_factory):
    p = tmp_path_factory.mktemp("gpu") / "profile.json"
    p.write_bytes(raw)
    run_cli(["estimate", "--preset", "seed", "--layers", "2", "--batch", "1", "--seq", "128", "--gpu", str(p),
             "--json"], "profile")
