"""The lock and the install: requirements.lock pins every dependency pyproject.toml names, within its bounds,
with hashes; torch and triton stay out of it (install.sh puts them first, so a GPU machine keeps its build); and
no module or folder of the repo shadows a package this environment can import."""
from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from scripts.relock import REQ, left_out, strip

ROOT = Path(__file__).resolve().parent.parent


def _entries(text: str) -> dict[str, tuple[str, str]]:
    """name -> (version, the entry's whole text) for each pinned requirement whose marker holds here."""
    out, cur, buf = {}, None, []
    for line in text.splitlines() + ["end==0"]:
        if m := REQ.match(line):
            if cur is not None:
                req = Requirement(buf[0].rstrip(" \\"))
                if req.marker is None or req.marker.evaluate(default_environment()):
                    out[cur] = (str(req.specifier).removeprefix("=="), "\n".join(buf))
            cur, buf = m.group(1).lower(), []
        buf.append(line)
    return out


def test_the_lock_pins_every_dependency_within_its_bounds_with_hashes():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"] + meta["optional-dependencies"]["hf"] + meta["optional-dependencies"]["train"]
    lock = _entries((ROOT / "requirements.lock").read_text())
    for d in map(Requirement, deps):
        name = d.name.lower()
        if left_out(name):
            assert name not in lock, f"{name} is install.sh's, not the lock's"
            continue
        assert name in lock, f"{name} is not in requirements.lock"
        version, entry = lock[name]
        assert d.specifier.contains(version, prereleases=True), f"{name}=={version} is outside {d.specifier}"
    for name, (version, entry) in lock.items():
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", entry), f"{name}=={version} has no hash"
        assert not left_out(name)


def test_relock_drops_torch_triton_and_what_only_they_pull():
    full = ("filelock==3.0 \\\n    --hash=sha256:" + "a" * 64 + "\n    # via torch\n"
            "nvidia-cublas==13.1 ; sys_platform == 'linux' \\\n    --hash=sha256:" + "b" * 64 + "\n"
            "torch==2.13.0 \\\n    --hash=sha256:" + "c" * 64 + "\n    # via liger-kernel\n"
            "triton==3.7.1 \\\n    --hash=sha256:" + "d" * 64 + "\n"
            "tqdm==4.70 \\\n    --hash=sha256:" + "e" * 64 + "\n")
    got = _entries(strip(full))
    assert sorted(got) == ["filelock", "tqdm"] and "b" * 64 not in strip(full)


def _shadowable_names() -> list[tuple[str, Path]]:
    """Each name a repo file can be imported as from the top: the repo's top-level modules and folders, and each
    module of bench/, scripts/ and validations/ (top-level names whenever one is run as a plain script:
    python3 bench/x.py puts bench/ first on sys.path)."""
    names = [(p.stem if p.is_file() else p.name, p) for p in ROOT.iterdir()
             if (p.is_dir() and not p.name.startswith(".")) or p.suffix == ".py"]
    names += [(p.stem, p) for d in ("bench", "scripts", "validations") for p in (ROOT / d).glob("*.py") if p.stem != "__init__"]
    return names


@pytest.mark.parametrize("name,path", _shadowable_names(), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_no_repo_module_shadows_an_installed_package(name, path):
    """transformers imports Hugging Face's `kernels`; a bench/kernels.py on sys.path once stood in its place.
    Each name a repo file can take at the top of sys.path must be one nothing installed here answers to."""
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != ROOT]
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
    finally:
        sys.path[:] = saved
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    assert spec is None or (origin and ROOT in origin.parents), f"{path.relative_to(ROOT)} shadows {spec.origin}"
