"""Install megatrain from this tree with no network (benchmarks/gpu/run.sh's first stage).

Usage: python benchmarks/gpu/install_offline.py --site DIR [--tests]
The project is laid into DIR as the package pyproject.toml describes (its `package-dir` map: megatrain/ with
ir/, models/, planner/, ... as its subpackages), by symbolic links to the tree, so nothing is built and no pip
is needed; put DIR on PYTHONPATH and run Python with -P (the tree's own megatrain/ folder, in the working
directory, holds only the top package). Dependencies come from the interpreter (an image with torch has most)
or, for those it lacks, from benchmarks/gpu/wheelhouse/ (`make wheelhouse` fills it on a machine with a
network) with `pip install --no-index --no-deps --target DIR`. Exit status 0 when everything imports, 3 with
one line per missing package otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "benchmarks" / "gpu" / "wheelhouse"
# import name of each distribution the runtime and the CUDA tests need
RUNTIME = {"torch": "torch", "numpy": "numpy", "pydantic": "pydantic", "networkx": "networkx", "jinja2": "jinja2",
           "rich": "rich", "safetensors": "safetensors"}
TESTS = {"pytest": "pytest"}
PEERS = {"deepspeed": "deepspeed"}  # the benchmark's peer; FSDP2 is in torch


def lay_out(site: Path, root: Path = ROOT) -> list[str]:
    """Link the tree's packages into `site` as pyproject.toml's package-dir maps them; the package names."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    site.mkdir(parents=True, exist_ok=True)
    for name in tool["packages"]:
        if name not in tool["package-dir"]:  # a subpackage (models.depth, codegen.templates): in its parent's link
            continue
        src = root / tool["package-dir"][name]
        dst = site.joinpath(*name.split("."))
        if name == "megatrain":  # the top package: its files, its subpackages linked beside them
            dst.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if f.suffix == ".py" and not (dst / f.name).exists():
                    (dst / f.name).symlink_to(f)
        elif not dst.exists():
            dst.symlink_to(src, target_is_directory=True)
    return tool["packages"]


def _pip_install(site: Path, peers: bool) -> None:
    """Every distribution of the wheelhouse this interpreter lacks (DeepSpeed only with `peers`), into `site`,
    each on its own (--no-deps: pip --target would otherwise install again what the interpreter has, torch and
    numpy above all, which the wheelhouse does not carry); pip picks each one's file for this Python."""
    dists = sorted({_dist(w) for w in WHEELHOUSE.glob("*.whl")} - {"torch"})
    dists = [d for d in dists if _version(d) is None and (peers or d != "deepspeed")]
    if dists:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                        str(WHEELHOUSE), "--target", str(site), *dists], check=False)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def _dist(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(names: dict[str, str]) -> list[str]:
    return [dist for dist, mod in names.items() if importlib.util.find_spec(mod) is None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", required=True, type=Path)
    ap.add_argument("--tests", action="store_true", help="also the test dependencies (pytest)")
    ap.add_argument("--peers", action="store_true", help="also DeepSpeed, the benchmark's peer, where the wheelhouse "
                    "has it (optional: nothing fails without it)")
    args = ap.parse_args(argv)
    need = {**RUNTIME, **(TESTS if args.tests else {})}
    lack = missing(need)
    wheels = WHEELHOUSE.is_dir() and any(WHEELHOUSE.glob("*.whl"))
    if wheels and (lack or (args.peers and missing(PEERS))):  # DeepSpeed optional: its row says when it lacks
        _pip_install(args.site, args.peers)
        lack = missing(need)
    if lack:
        for dist in lack:
            print(f"install_offline: {dist} is not importable and not in {WHEELHOUSE} "
                  "(run `make wheelhouse` on a machine with a network)", file=sys.stderr)
        return 3
    packages = lay_out(args.site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.site), os.environ.get("PYTHONPATH", "")])}
    check = subprocess.run([sys.executable, "-P", "-c", "import megatrain.runtime.trainer as t, megatrain.cli; "
                            "print(t.__file__)"], env=env, capture_output=True, text=True)
    if check.returncode == 0 and not check.stdout.strip().startswith(str(args.site)):
        check.returncode, check.stderr = 1, f"megatrain came from {check.stdout.strip()}, not {args.site}"
    if check.returncode:
        print(f"install_offline: the laid-out package does not import:\n{check.stderr}", file=sys.stderr)
        return 3
    print(f"install_offline: {len(packages)} packages linked into {args.site} ({check.stdout.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
