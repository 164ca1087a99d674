"""The device run's bundle (benchmarks/gpu/bundle.py, `make gpu-bundle`) and the whole run rehearsed on CPU
under the fake CUDA backend (`benchmarks/gpu/run.sh --rehearse`), from a clean copy of the tree."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
CARRY = 'carry:     ["benchmarks/gpu/bundle"]'


def test_without_the_bundle_the_device_script_stops_at_once_and_names_it(tmp_path):
    """The bundle is git-ignored, so a device call without `carry` gets a tree without it: the script says so
    in its first second, before any install or import of torch, and the summary names the folder."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "BUNDLE": str(tmp_path / "not-carried"), "TMPDIR": str(tmp_path)}
    t = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh")], env=env, capture_output=True, text=True)
    assert time.monotonic() - t < 2.0  # one second, with room for a loaded CI machine
    assert r.returncode == 3 and "was not carried" in r.stdout and 'carry ["benchmarks/gpu/bundle"]' in r.stdout
    stages = json.loads((out / "summary.json").read_text())["stages"]
    assert stages[0]["name"] == "bundle" and "not-carried missing" in stages[0]["status"]
    assert {s["status"] for s in stages[1:]} == {"pending"}


def test_the_bundle_is_exactly_what_the_image_lacks_and_is_checked_against_its_limit(tmp_path, monkeypatch):
    """For the device's Python 3.12 the wheels its image lacks (pydantic with its dependencies, hjson,
    nvidia-ml-py) and DeepSpeed built here without its ops; for this Python also what a venv of torch and numpy
    lacks (the rehearsal's). Over 30 MiB it fails."""
    import bundle

    assert {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson"} <= set(bundle.DEVICE_LACKS)
    assert {"pytest", "pytest-timeout", "rich", "safetensors", "ninja"} <= set(bundle.IMAGE_HAS)
    assert not {"torch", "numpy"} & set(bundle.DEVICE_LACKS + bundle.IMAGE_HAS)
    calls = []

    def run(cmd, check, env=None):
        calls.append((cmd, env))
        out = Path(cmd[cmd.index("-d") + 1] if "-d" in cmd else cmd[cmd.index("-w") + 1])
        (out / f"w{len(calls)}-1-py3-none-any.whl").write_bytes(b"x" * (11 << 20))

    monkeypatch.setattr(bundle.subprocess, "run", run)
    assert bundle.main(["--out", str(tmp_path)]) == 1  # 3 x 11 MiB > 30 MiB
    (device, _), (here, _), (ds, env) = calls
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert device[device.index("--python-version") + 1] == "3.12" and "--no-deps" in device
    assert [n.split("==")[0] for n in device[-len(bundle.DEVICE_LACKS):]] == bundle.DEVICE_LACKS
    assert here[here.index("--python-version") + 1] == py
    assert env["DS_BUILD_OPS"] == "0" and bundle.DEEPSPEED in ds and "--no-build-isolation" in ds


def test_the_device_call_is_written_down_with_its_carry():
    """The folder is ignored by git, so only the device call's `carry` takes it: run.sh's header, docs/GPU.md
    and the README give the same call."""
    import install_offline

    assert "/benchmarks/gpu/bundle/" in (ROOT / ".gitignore").read_text().split()
    assert install_offline.BUNDLE == ROOT / "benchmarks/gpu/bundle"
    assert CARRY in (ROOT / "benchmarks/gpu/run.sh").read_text()
    assert CARRY in (ROOT / "docs/GPU.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "docs/GPU.md" in readme and '["benchmarks/gpu/bundle"]' in readme


def test_a_built_bundle_holds_the_device_wheels_under_its_limit():
    folder = ROOT / "benchmarks/gpu/bundle"
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        pytest.skip("no bundle here: `make gpu-bundle` builds it (the rehearsal tests build it in their copy)")
    assert sum(w.stat().st_size for w in wheels) <= 30 * 2**20
    names = [w.name for w in wheels]
    assert any(n.startswith("pydantic_core-") and "-cp312-" in n for n in names)
    (ds,) = [w for w in wheels if w.name.startswith("deepspeed-")]
    assert ds.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(ds) as z:  # built with DS_BUILD_OPS=0: its ops are the device's JIT builder's
        info = z.read("deepspeed/git_version_info_installed.py").decode()
    assert "'cpu_adam': False" in info


def rehearse(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`make gpu-bundle && bash benchmarks/gpu/run.sh --rehearse` in a copy of the working tree (what a clean
    clone of it would hold: no venv, no bundle, no outputs), its .venv linked from this tree's."""
    copy = tmp_path / "tree"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "out", "bundle", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "build"))
    (copy / ".venv").symlink_to(ROOT / ".venv")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "TMPDIR": str(tmp_path)}
    env.pop("MEGATRAIN_CACHE", None)  # the rehearsal's venv is cached across runs (~/.cache/megatrain)
    # -o: the linked venv counts as installed, so make never reinstalls this tree's venv from the copy
    make = subprocess.run(["make", "-s", "-o", ".venv/.installed", "gpu-bundle"], cwd=copy, env=env,
                          capture_output=True, text=True)
    assert make.returncode == 0, make.stdout[-2000:] + make.stderr[-2000:]
    r = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--rehearse", *flags], cwd=copy, env=env,
                       capture_output=True, text=True, timeout=1500)
    return r, out


def check_rehearsal(r: subprocess.CompletedProcess, out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert r.returncode == 0, r.stdout[-6000:] + json.dumps(summary, indent=1)
    listed = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--list", "--rehearse"],
                            capture_output=True, text=True).stdout.split()
    assert [s["name"] for s in summary["stages"]] == [x.split("=")[0] for x in listed]
    assert summary["status"] == "ok"
    for s in summary["stages"]:
        assert s["status"].startswith(("passed", "measured", "rehearsed", "skipped")), s
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"run.log", "summary.json", "rows.jsonl", "cuda_tests.xml", "preflight.json",
                                "hardware.json", "results.md"} <= set(files)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    stages = {s["name"] for s in summary["stages"]}
    assert {r["stage"] for r in rows} == {s for s in stages if s == "headline" or s.startswith(("peer-", "qwen"))}
    return {s["name"]: s["status"] for s in summary["stages"]}


@pytest.mark.slow
def test_the_short_rehearsal_runs_every_stage():
    """What CI runs (.ci/run): every stage, DeepSpeed's CPU Adam build left to the full rehearsal (said)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        status = check_rehearsal(*rehearse(Path(tmp), "--short"))
    assert status["ds-cpu-adam"].startswith("rehearsed: not built: the short rehearsal")
    assert "DeepSpeedCPUAdam is not built (not built: the short" in status["peer-3-deepspeed"]


@pytest.mark.slow
def test_the_full_rehearsal_builds_deepspeeds_cpu_adam_and_runs_every_stage(tmp_path):
    status = check_rehearsal(*rehearse(tmp_path))
    assert status["ds-cpu-adam"].startswith("rehearsed: DeepSpeedCPUAdam built")
    assert status["peer-3-deepspeed"].startswith("rehearsed: deepspeed wiring with DeepSpeedCPUAdam")
