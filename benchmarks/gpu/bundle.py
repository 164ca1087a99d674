"""`make gpu-bundle`: the wheels the device run needs and the device image lacks, in one folder the device
call carries (benchmarks/gpu/bundle/, git-ignored; docs/GPU.md).

Usage (where a package registry is reachable, before the device call):
    python benchmarks/gpu/bundle.py [--out benchmarks/gpu/bundle] [--device-python 3.12]
The device image (Python 3.12, torch, no network) has most of what megatrain, its CUDA tests and the peers
import; DEVICE_LACKS is what it does not have, downloaded for its Python, with DeepSpeed built here as a pure
wheel without its ops (DS_BUILD_OPS=0: its CPU Adam is built on the device by DeepSpeed's own JIT builder,
benchmarks/gpu/peers.py). The CPU rehearsal (`run.sh --rehearse`) installs from the same folder into a venv
of torch and numpy alone, so for this interpreter's Python the folder also holds what the image has and such a
venv lacks (IMAGE_HAS). Every wheel is pinned to the version this interpreter has when it has one (the
versions the test suite ran with: pydantic and pydantic-core must match), so the folder is the same set on
every rebuild. The folder is emptied first, and its size is checked against the device call's carry limit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "benchmarks" / "gpu" / "bundle"
MAX_BYTES = 30 * 2**20  # the carry takes 64 MiB with the tree; the bundle keeps under half of it
# what the device image lacks (its package list is in docs/GPU.md): pydantic with its dependencies for megatrain,
# hjson and nvidia-ml-py for DeepSpeed (the DeepSpeed wheel itself is built, below)
DEVICE_LACKS = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson", "nvidia-ml-py"]
# what the image has that a venv of torch and numpy lacks and megatrain, the CUDA tests or the peers import
# (torch brings networkx, jinja2 and typing-extensions)
IMAGE_HAS = ["rich", "markdown-it-py", "mdurl", "pygments", "safetensors", "pytest", "pluggy", "iniconfig",
             "packaging", "pytest-timeout", "psutil", "py-cpuinfo", "tqdm", "msgpack", "einops", "ninja"]
DEEPSPEED = "deepspeed==0.19.8"  # the version peers.py's config and CPU Adam use was written against
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def pinned(names: list[str]) -> list[str]:
    """`name==version` where this interpreter has `name` installed, else `name` (the newest)."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def download(names: list[str], python: str, out: Path) -> None:
    """Binary wheels of exactly `names` (no dependencies: the lists above are the whole set) for CPython
    `python` on x86-64 Linux."""
    tag = python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
           "--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
           "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + pinned(names), check=True)


def build_deepspeed(out: Path) -> None:
    """DeepSpeed is published as a source archive only: built here into a pure wheel, none of its ops compiled
    (they need the device's CUDA). Its setup imports torch, so it builds in this interpreter (no isolation)."""
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    DEEPSPEED], check=True, env=env)


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUNDLE)
    ap.add_argument("--device-python", default="3.12", help="the device image's Python")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.out.glob("*.whl"):  # the folder is exactly this run's set
        f.unlink()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    download(DEVICE_LACKS, args.device_python, args.out)
    if here != args.device_python:  # the rehearsal's interpreter: what the image lacks and what it has
        download(DEVICE_LACKS + IMAGE_HAS, here, args.out)
    else:
        download(IMAGE_HAS, here, args.out)
    build_deepspeed(args.out)
    total = size(args.out)
    wheels = sorted(f.name for f in args.out.glob("*.whl"))
    print("\n".join(wheels))
    print(f"gpu-bundle: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out} "
          f"(Python {args.device_python} for the device, {here} for the rehearsal)")
    if total > MAX_BYTES:
        print(f"gpu-bundle: {total / 2**20:.1f} MiB is over the {MAX_BYTES / 2**20:.0f} MiB the device call's "
              "carry leaves for it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
