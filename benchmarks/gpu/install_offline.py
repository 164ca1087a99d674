"""Install megatrain from this tree with no network (benchmarks/gpu/run.sh's first stage).

Usage: python benchmarks/gpu/install_offline.py --site DIR [--tests] [--peers]
The project's one package, megatrain/ (laid out as imported), is linked into DIR, so nothing is built and no
pip is needed; put DIR on PYTHONPATH and run Python with -P. Dependencies come from the interpreter (an image with torch has most)
or, for those it lacks, from benchmarks/gpu/bundle/ (`make gpu-bundle` fills it where a registry is reachable;
the device call must carry it: it is git-ignored, so the copy of the tree leaves it out) with `pip install
--no-index --no-deps --target DIR`. Exit status 0 when everything imports, 3 with one line per missing
package otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "benchmarks" / "gpu" / "bundle"
# import name of each distribution the runtime and the CUDA tests need
RUNTIME = {"torch": "torch", "numpy": "numpy", "pydantic": "pydantic", "networkx": "networkx", "jinja2": "jinja2",
           "rich": "rich", "safetensors": "safetensors"}
TESTS = {"pytest": "pytest", "pytest-timeout": "pytest_timeout"}  # run.sh gives each CUDA test a time limit
PEERS = {"deepspeed": "deepspeed"}  # the benchmark's peer; FSDP2 is in torch


def lay_out(site: Path, root: Path = ROOT) -> list[str]:
    """Link the tree's package (megatrain/, laid out as imported) into `site`; its package names."""
    site.mkdir(parents=True, exist_ok=True)
    dst = site / "megatrain"
    if not dst.exists():
        dst.symlink_to(root / "megatrain", target_is_directory=True)
    return sorted(".".join(p.relative_to(root).parts[:-1]) for p in (root / "megatrain").rglob("__init__.py"))


def _pip_install(site: Path, peers: bool, bundle: Path | None = None) -> None:
    """Every distribution of the bundle this interpreter lacks (DeepSpeed only with `peers`), into `site`,
    each on its own (--no-deps: pip --target would otherwise install again what the interpreter has, torch and
    numpy above all, which the bundle does not carry); pip picks each one's file for this Python."""
    bundle = bundle or BUNDLE
    dists = sorted({_dist(w) for w in bundle.glob("*.whl")} - {"torch"})
    dists = [d for d in dists if _version(d) is None and (peers or d != "deepspeed")]
    if dists and importlib.util.find_spec("pip") is None:  # an image without pip: the wheels unzipped
        _unzip(site, bundle, dists)
    elif dists:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                        str(bundle), "--target", str(site), *dists], check=False)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def _unzip(site: Path, bundle: Path, dists: list[str]) -> None:
    """What pip --target does for these wheels, less their scripts: each unzipped into `site`, the file for this
    Python picked by its tag (cpXY, or one for any Python 3)."""
    tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
    site.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        fit = [w for w in sorted(bundle.glob("*.whl")) if _dist(w) == dist
               and (tag in w.name or "-py3-none-" in w.name or "-abi3-" in w.name)]
        if fit:
            with zipfile.ZipFile(fit[-1]) as z:
                z.extractall(site)


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
    ap.add_argument("--bundle", type=Path, default=BUNDLE, help="the folder of wheels (default: %(default)s)")
    ap.add_argument("--gpu-file", type=Path, default=None, help="where to write the GPU's name (empty: none)")
    ap.add_argument("--tests", action="store_true", help="also the test dependencies (pytest)")
    ap.add_argument("--peers", action="store_true", help="also DeepSpeed, the benchmark's peer, where the bundle "
                    "has it (optional: its row says when it is missing)")
    args = ap.parse_args(argv)
    need = {**RUNTIME, **(TESTS if args.tests else {})}
    lack = missing(need)
    wheels = args.bundle.is_dir() and any(args.bundle.glob("*.whl"))
    if wheels and (lack or (args.peers and missing(PEERS))):  # DeepSpeed optional: its row says when it lacks
        _pip_install(args.site, args.peers, args.bundle)
        lack = missing(need)
    if lack:
        for dist in lack:
            where = f"not in {args.bundle}" if wheels else f"and {args.bundle} was not carried"
            print(f"install_offline: {dist} is not importable {where} (`make gpu-bundle` where a registry is "
                  'reachable, then the device call with carry ["benchmarks/gpu/bundle"])', file=sys.stderr)
        return 3
    packages = lay_out(args.site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.site), os.environ.get("PYTHONPATH", "")])}
    # the import check also names the GPU torch sees (run.sh's next question), so no other process starts torch
    check = subprocess.run([sys.executable, "-P", "-c", "import megatrain.runtime.trainer as t, megatrain.cli, torch; "
                            "print(t.__file__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() "
                            "else '')"], env=env, capture_output=True, text=True)
    where, _, gpu = check.stdout.strip().partition("\n")
    if check.returncode == 0 and not where.startswith(str(args.site)):
        check.returncode, check.stderr = 1, f"megatrain came from {where}, not {args.site}"
    if check.returncode:
        print(f"install_offline: the laid-out package does not import:\n{check.stderr}", file=sys.stderr)
        return 3
    if args.gpu_file:
        args.gpu_file.write_text(gpu.strip() + "\n")
    print(f"install_offline: {len(packages)} packages linked into {args.site} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
