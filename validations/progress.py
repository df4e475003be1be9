"""A progress line per part of a long run: before the first test of each test file, one line with the part's
index, its test count, and how far the run is (tests done, seconds). The GPU suite (every selected test marked
gpu) prints them by itself, so a 10-minute `pytest validations -m gpu` says where it is; `--parts` asks for them
on any run. conftest.py registers the plugin; `-p validations.progress` does elsewhere."""
from __future__ import annotations

import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--parts", action="store_true",
                     help="print a progress line per test file (on by itself when every selected test is gpu-marked)")


class Parts:
    """The run's parts in collection order: each file's first test id and its test count."""

    def __init__(self, items: list) -> None:
        self.first: dict[str, tuple[int, str, int]] = {}  # nodeid -> (part index, file, tests)
        files: dict[str, list[str]] = {}
        for it in items:
            files.setdefault(it.nodeid.split("::")[0], []).append(it.nodeid)
        for i, (name, ids) in enumerate(files.items(), 1):
            self.first[ids[0]] = (i, name, len(ids))
        self.parts, self.tests, self.done, self.t0 = len(files), len(items), 0, time.monotonic()

    def line(self, nodeid: str) -> str | None:
        """The line to print before this test, or None inside a part; counts the test as started."""
        hit = self.first.get(nodeid)
        self.done += 1
        if hit is None:
            return None
        i, name, n = hit
        return (f"-- part {i}/{self.parts} {name}: {n} test{'s' * (n != 1)} "
                f"({self.done - 1} of {self.tests} done, {time.monotonic() - self.t0:.0f} s)")


_KEY = pytest.StashKey[Parts]()


def pytest_collection_finish(session):
    items = session.items
    if items and (session.config.getoption("--parts") or all("gpu" in it.keywords for it in items)):
        session.config.stash[_KEY] = Parts(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    parts = item.config.stash.get(_KEY, None)
    term = item.config.pluginmanager.get_plugin("terminalreporter")
    text = parts.line(item.nodeid) if parts else None
    if text and term:
        tw = getattr(term, "_tw", None)  # -q prints dots without a file name: end their line first
        if tw is not None and tw.width_of_current_line:
            term.write("\n")
        term.write_line(text)
