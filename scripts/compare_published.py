"""Write the published-runs comparison (llm_anatomy/report/published.py) to reports/derived-gpus/published.json
and print its table (pure Python, no GPU):

    python3 -m scripts.compare_published [--check]

--check writes nothing: it exits 1 where the committed file differs from what the derived profiles predict now.
"""
from __future__ import annotations

import argparse
import json
import sys

from llm_anatomy.io import write_atomic
from llm_anatomy import records
from llm_anatomy.report.published import comparison, table


def render(cmp: dict) -> str:
    return json.dumps(cmp, indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed file; write nothing")
    a = p.parse_args(argv)
    cmp, path = comparison(), records.DERIVED_GPUS
    text = render(cmp)
    if a.check:
        current = path.is_file() and path.read_text() == text
        print(f"{records.rel(path)}: {'current' if current else 'stale: run python3 -m scripts.compare_published'}")
        return 0 if current else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    print(table(cmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
