"""The GPU suite in parts: `python3 -m scripts.suite_parts K/N [--benchmarks]` prints the test files of part K of N
(with --benchmarks, only those that hold a benchmark), one a line.

The gpu-marked test files (validations/test_*.py that hold a `pytest.mark.gpu`) in name order, cut into N runs of
consecutive files, as even in file count as the order allows; scripts/gpu_suite.sh --part K/N runs one. A part that
holds no benchmark runs without the gate's flags (gpu_suite.sh drops them and says so): a gated run without a
benchmark is a usage error (validations/bench_gate.py). Each part of two holds benchmarks (the kernels and models
in the first, the optimizer's step bandwidth in the second); of three, the third holds none."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

VALIDATIONS = Path(__file__).resolve().parent.parent / "validations"


def _gpu_marked(path: Path) -> bool:
    """Does the file mark a test gpu: a top-level test function decorated `pytest.mark.gpu`, or `pytestmark`
    naming it (read from the syntax tree: a string that mentions the mark does not count)."""
    def is_gpu(node) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
                   and n.value.attr == "mark" for n in ast.walk(node))

    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and any(map(is_gpu, node.decorator_list)):
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if is_gpu(node.value):
                return True
    return False


def gpu_files() -> list[str]:
    return [f"validations/{p.name}" for p in sorted(VALIDATIONS.glob("test_*.py")) if _gpu_marked(p)]


def holds_benchmarks(path: str) -> bool:
    """Does the test file define a top-level test that takes pytest-benchmark's `benchmark` fixture."""
    tree = ast.parse((VALIDATIONS.parent / path).read_text(encoding="utf-8"))
    return any(isinstance(f, ast.FunctionDef) and f.name.startswith("test") and any(a.arg == "benchmark" for a in f.args.args)
               for f in tree.body)


def part(k: int, n: int, files: list[str] | None = None) -> list[str]:
    files = gpu_files() if files is None else files
    return files[(k - 1) * len(files) // n: k * len(files) // n]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench = "--benchmarks" in argv
    argv = [a for a in argv if a != "--benchmarks"]
    try:
        if len(argv) != 1:
            raise ValueError
        k, n = (int(x) for x in argv[0].split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        print(f"suite_parts: error: expected K/N with 1 <= K <= N, got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    print("\n".join(f for f in part(k, n) if not bench or holds_benchmarks(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
