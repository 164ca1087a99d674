"""How much of megatrain's CUDA-only code the fake CUDA backend executes (docs/RESULTS.md, "CUDA path in CI").

    .venv/bin/python benchmarks/cuda_coverage.py            # runs `pytest -m cuda` on the fake backend
    .venv/bin/python benchmarks/cuda_coverage.py --data F   # reads an existing coverage data file instead

CUDA-only lines are found in the source, not listed by hand: the body of `class CudaDevice` and of functions
named for the allocator, a branch taken only on a GPU (an `if` on `.is_cuda`, `kind == "cuda"`,
`device == "cuda"` or torch.cuda.is_available(), its else branch for a negated test), and every statement
that calls torch.cuda. Prints a table per file and the missed lines; needs the `coverage` package.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("megatrain",)
SKIP = ("megatrain/fake_cuda",)  # the stand-in itself is not the code under test


def _mentions_cuda(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return ("is_cuda" in text or "'cuda'" in text or '"cuda"' in text or "torch.cuda" in text
            or any(isinstance(n, ast.Attribute) and n.attr == "cuda" for n in ast.walk(node)))


def _negated(test: ast.AST) -> bool:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    return isinstance(test, ast.Compare) and any(isinstance(op, (ast.NotEq, ast.IsNot)) for op in test.ops)


def _no_gpu_branch(node: ast.AST) -> bool:
    """`if not torch.cuda.is_available(): ...`: what a machine without a GPU runs, not CUDA code."""
    return isinstance(node, ast.If) and "is_available" in ast.unparse(node.test) and _negated(node.test)


def _lines(stmts) -> set[int]:
    out = set()
    skip = {id(n) for s in stmts for b in ast.walk(s) if _no_gpu_branch(b) for n in ast.walk(b)}
    for s in stmts:
        for n in ast.walk(s):
            if id(n) in skip:
                continue
            if isinstance(n, ast.stmt) and not isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)):  # docstrings
                    out.add(n.lineno)
    return out


def cuda_lines(path: Path) -> set[int]:
    """The CUDA-only statement lines of one file (module docstring)."""
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and "Cuda" in node.name:
            lines |= _lines(node.body)
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("allocator_"):
            lines |= _lines(node.body)
        elif isinstance(node, (ast.If, ast.IfExp)) and isinstance(node, ast.If) and _mentions_cuda(node.test):
            if "is_available" in ast.unparse(node.test) and "not" in ast.unparse(node.test).split()[0:1]:
                continue  # `if not torch.cuda.is_available(): raise ...`: the CPU's branch
            branch = node.orelse if _negated(node.test) else node.body
            if not (len(branch) == 1 and isinstance(branch[0], ast.Raise)):
                lines |= _lines(branch)
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For,
                                                                    ast.While, ast.With, ast.Try)):
            if "torch.cuda." in ast.unparse(node):
                lines.add(node.lineno)
    return lines


def files() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith(SKIP) and cuda_lines(p):
                out.append(p)
    return out


def run_tests(data: Path) -> int:
    rc_file = data.with_name("coveragerc")
    rc_file.write_text(f"[run]\nconcurrency = thread\nparallel = true\npatch = subprocess\n"
                       f"source = {', '.join(FOLDERS)}\ndata_file = {data}\n")
    env = {**os.environ, "MEGATRAIN_FAKE_CUDA": "1", "COVERAGE_RCFILE": str(rc_file)}
    cmd = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)  # torchrun's ranks are measured too (patch = subprocess)
    subprocess.call([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env)
    return rc


def report(data: Path) -> float:
    from coverage import Coverage

    cov = Coverage(data_file=str(data))
    cov.load()
    measured = cov.get_data()
    total = hit = 0
    print(f"{'file':<34} {'CUDA-only lines':>15} {'executed':>9} {'share':>6}  missed")
    for p in files():
        want = cuda_lines(p)
        executed = set(measured.lines(str(p)) or ())
        got = want & executed
        total, hit = total + len(want), hit + len(got)
        missed = sorted(want - executed)
        print(f"{p.relative_to(ROOT).as_posix():<34} {len(want):>15} {len(got):>9} {len(got) / len(want):>6.0%}  "
              f"{','.join(map(str, missed[:12]))}{' ...' if len(missed) > 12 else ''}")
    share = hit / total if total else 1.0
    print(f"{'all':<34} {total:>15} {hit:>9} {share:>6.1%}")
    return share


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="an existing coverage data file (default: run the tests)")
    args = ap.parse_args(argv)
    if args.data is None:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / ".coverage"
            rc = run_tests(data)
            print(f"pytest -m cuda on the fake backend: exit {rc}")
            report(data)
            return rc
    report(args.data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
