"""The known misses of the timing claims, read from the one data file that lists them (known_misses.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

MISSES = json.loads(Path(__file__).with_name("known_misses.json").read_text())["misses"]


def of(test: str) -> dict[str, dict]:
    """{case id: entry} of one test ("validations/<file>::<test function>")."""
    return {m["id"]: m for m in MISSES if m["test"] == test}


def param(test: str, case_id: str, *values):
    """A pytest case; a known miss is a strict xfail whose reason carries its measured error and cause."""
    m = of(test).get(case_id)
    marks = [pytest.mark.xfail(strict=True, reason=f"known miss, {m['error']:+.1%}: {m['cause']}")] if m else []
    return pytest.param(*values, id=case_id, marks=marks)


def unused(test: str, case_ids) -> set[str]:
    """Entries of `test` that name no case: a stale entry (its case renamed or gone)."""
    return set(of(test)) - set(case_ids)
