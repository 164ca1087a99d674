"""The device run (benchmarks/gpu/run.sh) and its parts, rehearsed on CPU: it installs from the tree and reports
"no GPU" cleanly; the CUDA test run fails rather than skips without a GPU; each case is its own process under
its own limit, the headline first; the benchmark plans with the kind's host memory, not MemAvailable; the
benchmark's cases, FLOP count, busy shares and table; the peers' wiring. The bundle and the whole rehearsal:
tests/test_gpu_bundle.py."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="rehearses the machine without a GPU")
GiB = 2**30


def _wheel(folder: Path, dist: str, module: str) -> None:
    """A minimal wheel holding an empty `module`: a bundle for an interpreter that lacks only it."""
    name = f"{dist.replace('-', '_')}-1.0"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}.py", "")
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")


@no_gpu
def test_the_device_script_installs_from_the_tree_and_reports_no_gpu(tmp_path):
    out, bundle = tmp_path / "out", tmp_path / "bundle"
    bundle.mkdir()
    _wheel(bundle, "pytest-timeout", "pytest_timeout")  # the one test dependency the dev venv may lack
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "PIP_NO_INDEX": "1",
           "BUNDLE": str(bundle)}
    env.pop("MEGATRAIN_FAKE_CUDA", None)
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh")], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    packages = list((ROOT / "megatrain").rglob("__init__.py"))
    assert f"{len(packages)} packages linked into" in r.stdout and "no GPU visible" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status["bundle"] == status["install"] == "passed" and status["headline"] == "no gpu"
    assert summary["status"].startswith("not ok")
    assert "no GPU visible" in (out / "run.log").read_text()  # the log is in $OUT too
    assert not list(tmp_path.glob("megatrain-gpu.*"))  # its install removed on exit


def test_the_laid_out_package_imports_from_its_site_with_its_data(tmp_path):
    from install_offline import lay_out

    assert "megatrain.runtime" in lay_out(tmp_path / "site")
    code = ("import megatrain.runtime.trainer as t, megatrain.codegen as c, megatrain.models.depth, pathlib; "
            "print(t.__file__); "
            "print(len(list((pathlib.Path(c.__file__).parent / 'templates').glob('*.j2'))))")
    r = subprocess.run([sys.executable, "-P", "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                       capture_output=True, text=True, cwd=ROOT)
    where, templates = r.stdout.split()
    assert where.startswith(str(tmp_path / "site")) and int(templates) > 0
    # the top package's own folders (megatrain/fake_cuda/, the rehearsal's backend) are linked in too
    own = [d.name for d in (ROOT / "megatrain").iterdir() if (d / "__init__.py").exists()]
    assert all((tmp_path / "site" / "megatrain" / d / "__init__.py").exists() for d in own)


@no_gpu
def test_a_cuda_test_run_without_a_gpu_fails_instead_of_skipping_everything(tmp_path, monkeypatch):
    from cuda_gate import cuda_run_without_a_gpu

    monkeypatch.delenv("MEGATRAIN_FAKE_CUDA", raising=False)
    assert "torch sees no GPU" in cuda_run_without_a_gpu("cuda", {})
    assert "torch sees no GPU" in cuda_run_without_a_gpu("not slow", {"MEGATRAIN_REQUIRE_CUDA": "1"})
    assert cuda_run_without_a_gpu("not slow and not cuda", {}) is None
    env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_FAKE_CUDA"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "tests/runtime/test_cuda.py"], cwd=ROOT,
                       capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "every one would be skipped" in r.stdout + r.stderr


def _stages(*flags) -> list[tuple[str, int]]:
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--list", *flags], capture_output=True,
                       text=True, check=True)
    return [(n, int(v)) for n, _, v in (line.partition("=") for line in r.stdout.split())]


def test_each_case_is_its_own_stage_the_headline_first_within_eight_minutes():
    """Every case and peer run is a stage of its own with its own limit (one process under `timeout`), the
    headline llama3-8b at 8192 right after the tests, the peers interleaved; the clocked stages (the DeepSpeed
    build runs beside them) take at most 8 minutes on either kind. The rehearsal runs the same stages."""
    stages = _stages()
    names = [n for n, _ in stages]
    assert names == ["bundle", "install", "preflight", "ds-cpu-adam", "cuda-tests", "headline",
                     "peer-1-megatrain", "peer-2-fsdp2", "peer-3-deepspeed", "peer-4-megatrain", "peer-5-fsdp2",
                     "peer-6-deepspeed", "qwen2.5-14b", "headline-streamed", "table", "depth-throughput"]
    limits = dict(stages)
    assert limits["preflight"] <= 20 and limits["cuda-tests"] <= 90
    # the optional stages run only in the time the run has left (test_the_depth_stage_runs_in_the_time_left)
    assert sum(v for n, v in stages if n not in ("ds-cpu-adam", "headline-streamed", "depth-throughput")) <= 480
    assert [n for n, _ in _stages("--rehearse") if n != "venv"] == names
    script = (ROOT / "benchmarks/gpu/run.sh").read_text()
    assert "HEADLINE=llama3-8b@8192" in script and "BIG=qwen2.5-14b@4096" in script
    # each gpu_step.py and peers.py run goes through `stage` (timeout), one case each
    for line in re.findall(r".*benchmarks/(?:gpu_step|gpu/peers)\.py.*", script):
        assert "--models \"$" in line or "--case \"$" in line or "--build-cpu-adam" in line, line


def test_the_cuda_tests_run_every_test_with_a_per_test_limit_and_report_to_out():
    script = (ROOT / "benchmarks/gpu/run.sh").read_text()
    cmd = re.search(r"stage cuda-tests (.*?)\n[^ ]", script, re.S).group(1)
    assert " -x" not in cmd and "--timeout" in cmd and '--junitxml "$OUT/cuda_tests.xml"' in cmd
    assert 'tee -a "$OUT/run.log"' in script


def test_the_summary_lists_every_stage_and_reads_rows_junit_and_cut_offs(tmp_path):
    import summary

    f, rows = str(tmp_path / "summary.json"), tmp_path / "rows.jsonl"
    summary.main(["init", f, "--mode", "device", "a=10", "b=20", "c=5", "d=1"])
    assert [s["status"] for s in summary.load(f)["stages"]] == ["pending"] * 4
    rows.write_text(json.dumps({"stage": "a", "status": "measured: 1,000 tokens/s"}) + "\n")
    summary.main(["done", f, "a", "0", "3.2", "--rows", str(rows)])
    summary.main(["done", f, "b", "124", "20.1", "--rows", str(rows)])
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
                     '<testcase classname="tests.runtime.test_cuda" name="test_x"><failure/></testcase>'
                     '<testcase classname="t" name="ok1"/><testcase classname="t" name="ok2"/></testsuite></testsuites>')
    summary.main(["done", f, "c", "1", "4", "--junit", str(junit)])
    status = {s["name"]: s["status"] for s in summary.load(f)["stages"]}
    assert status["a"] == "measured: 1,000 tokens/s"
    assert status["b"] == "cut off at 20 s before its row was written"
    assert status["c"] == "failed: 2 passed, 1 failed, 0 skipped; failed: test_cuda::test_x"
    assert summary.main(["final", f]) == 1 and summary.load(f)["status"] == "not ok: b, c; not run: d"


def test_benchmark_cases_flops_and_busy_shares():
    import gpu_step

    from megatrain.ir.trace import trace

    cases = [gpu_step.parse_case(c, 4096) for c in gpu_step.DEFAULT_CASES.split(",")]
    assert [(c.name, c.n_layers, s) for c, s in cases] == [("llama3-8b", 32, 8192), ("qwen2.5-14b", 48, 4096)]
    assert gpu_step.parse_case("llama3-8b:4@2048", 4096)[0].name == "llama3-8b-4L"
    for config, seq in cases:  # 6 x (every parameter but the input embedding; norms aside) + attention
        n = trace(config, 1, 128, "bf16").params_total - config.vocab_size * config.d_model
        want = 6 * n + 6 * config.n_layers * config.d_model * seq
        assert abs(gpu_step.model_flops_per_token(config, seq) - want) / want < 1e-4
    spans = [("compute", "f", 1, 0.0, 0.6, 0), ("h2d", "l", 1, 0.1, 0.3, 0), ("compute", "b", 1, 0.6, 0.8, 0)]
    assert gpu_step.busy_shares(spans, 1.0) == {"compute": 0.8, "h2d": 0.2}


def _args(**kw):
    import argparse

    base = dict(hardware="h100-sxm", host_mem="120GiB", host_policy="auto", resident="auto", gpu_mem="60GiB",
                seq_len=4096, micro_batch=1, grad_accum=4, device="cuda", steps=1)
    return argparse.Namespace(**{**base, **kw})


def test_the_benchmark_plans_with_the_kinds_host_memory_not_memavailable(monkeypatch):
    """A lent machine's MemAvailable at start is far below the 128 GiB it grows to: the cases plan with the
    profile's host memory (the preflight's 120 GiB, or --host-mem), so llama3-8b at 8192 keeps its exact state
    and qwen2.5-14b fits under a compact one, which auto takes (bf16-moments, within the tolerance since its
    moments are rounded stochastically) and run.sh names too; MemAvailable is never read for the plan."""
    import gpu_step
    import preflight

    from megatrain.runtime import trainer

    monkeypatch.setattr(trainer, "available_host_bytes", lambda: pytest.fail("read MemAvailable"))
    *_, row = gpu_step.plan_case("llama3-8b@8192", _args())
    assert row["host_policy"] == "exact" and row["host_memory_bytes"] == 120 * GiB and "skipped" not in row
    *_, row = gpu_step.plan_case("qwen2.5-14b@4096", _args())
    assert row["host_policy"] == "bf16-moments" and "skipped" not in row  # auto: exact does not fit
    *_, row = gpu_step.plan_case("qwen2.5-14b@4096", _args(host_policy="bf16-moments"))
    assert row["host_policy"] == "bf16-moments" and row["host_bytes"] <= 120 * GiB
    assert (preflight.KIND_HOST_GIB - preflight.HEADROOM_GIB) * GiB == 120 * GiB


@no_gpu
def test_the_preflight_writes_a_profile_with_the_kinds_host_memory_under_fake_cuda(tmp_path):
    """The preflight measures on the (here fake) GPU and writes the profile the cases plan with: this machine's
    24 GiB are not what it says, the kind's 128 GiB less the headroom is; the peers' case and megatrain's
    budget come with it."""
    from megatrain.planner import load_hardware

    env = {**os.environ, "MEGATRAIN_FAKE_CUDA": "1"}
    r = subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks/gpu/preflight.py"), "--quick", "--profile",
                        str(tmp_path / "hw.json"), "--json", str(tmp_path / "pf.json")], env=env, capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    hw, pf = load_hardware(tmp_path / "hw.json"), json.loads((tmp_path / "pf.json").read_text())
    assert hw.host_memory_bytes == pf["host_memory_bytes"] == 120 * GiB and "kind" in pf["host_memory_from"]
    assert hw.h2d_bytes_per_s == pf["h2d_bytes_per_s"] and hw.matmul_flops["bfloat16"] == pf["bf16_matmul_flops"]
    assert pf["cast_bf16_elements_per_s"]["1"] > 0 and pf["host_optimizer_bytes_per_s"]["exact"] > 0
    assert pf["peer_case"].startswith("llama2-7b:") and pf["gpu_budget_bytes"] < hw.gpu_memory_bytes


def test_the_trainers_host_memory_check_takes_the_explicit_override(monkeypatch, tmp_path):
    """Trainer refuses a plan above MemAvailable; MEGATRAIN_HOST_MEM (what run.sh sets from the preflight) is
    the figure it checks instead, both ways."""
    from megatrain.models import preset
    from megatrain.planner import TrainSpec
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import HOST_MEM_ENV, HostMemoryError, Trainer, available_host_bytes

    monkeypatch.setenv(HOST_MEM_ENV, "1TiB")
    assert available_host_bytes() == 2**40
    monkeypatch.setenv(HOST_MEM_ENV, "lots")
    with pytest.raises(ValueError, match="MEGATRAIN_HOST_MEM='lots'"):
        available_host_bytes()
    monkeypatch.setenv(HOST_MEM_ENV, "1KiB")
    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=2)
    with pytest.raises(HostMemoryError, match=r"only 1 KiB \(1,024 bytes\)"):  # a preset plans with its own
        Trainer(RunConfig(model=preset("tiny"), train=train, gpu_mem=6 * 2**20, device="sim", hardware="cpu"))
    with pytest.raises(ValueError, match=r"host memory 1 KiB is too small"):  # planned for this machine: with it
        Trainer(RunConfig(model=preset("tiny"), train=train, gpu_mem=6 * 2**20, device="sim"))


def test_the_benchmark_frees_each_case_before_the_next(monkeypatch, capsys):
    """A Trainer, its Engine, device and store hold one another; with the cyclic GC off (the planner turns it
    off while it plans) a finished case stays alive until collected: main collects it before the next."""
    import gc
    import weakref

    import gpu_step

    from megatrain.runtime import trainer

    made, init = [], trainer.Trainer.__init__

    def tracked(self, *a, **kw):
        made.append(weakref.ref(self))
        init(self, *a, **kw)

    monkeypatch.setattr(trainer.Trainer, "__init__", tracked)
    seen = []
    real_free = gpu_step.free_case
    monkeypatch.setattr(gpu_step, "free_case", lambda: (real_free(), seen.append([r() is None for r in made])))
    gc.disable()
    try:
        assert gpu_step.main(["--models", "tiny@64,tiny@32", "--device", "sim", "--hardware", "cpu", "--gpu-mem",
                              "64MiB", "--steps", "1", "--grad-accum", "2"]) == 0
    finally:
        gc.enable()
    assert seen == [[True], [True, True]]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"].split(":")[0] for r in rows] == ["measured", "measured"]


def test_the_results_table_has_a_row_per_case_with_measured_beside_planned():
    from table import peer_table, table

    rows = [{"system": "megatrain", "case": "1b@2048", "seq_len": 2048, "tokens_per_s": 12345.6, "model_tflops": 81.2,
             "mfu": 0.082, "measured_step_s": 0.66, "predicted_step_s": 0.5, "peak_device_bytes": 3 * GiB,
             "planned_peak_device_bytes": 4 * GiB, "peak_reserved_bytes": 5 * GiB,
             "planned_peak_reserved_bytes": 6 * GiB, "host_rss_bytes": 20 * GiB, "host_bytes": 16 * GiB,
             "host_policy": "exact", "busy_share": {"compute": 0.5, "host": 0.9}},
            {"case": "llama3-8b", "seq_len": 4096, "skipped": "host state 105.4 GiB > 90% of available"}]
    text = table(rows, "H200")
    assert "| 1b@2048 | 2048 | 12,346 | 81.2 | 8.2% | 0.660 (0.500) | 3.0 (4.0) | 5.0 (6.0) | 20.0 (16.0) | exact " \
           "| host 90% |" in text
    assert "| llama3-8b | 4096 | host state 105.4 GiB > 90% of available |" in text
    more = [{"system": "megatrain", "case": "1b@2048", "tokens_per_s": 3000.0},
            {"system": "megatrain", "case": "1b@2048", "tokens_per_s": 2000.0}]
    theirs = [{"case": "1b@2048", "system": "fsdp2", "tokens_per_s": 1200.0, "model_tflops": 20.0,
               "optimizer": "torch AdamW fused"}]
    assert "| 1b@2048 | fsdp2 | 1,200 | 2.50x | 20.0 |" in peer_table(more, theirs)  # megatrain's median run


@no_gpu
def test_the_gpu_benchmark_says_it_measured_nothing_without_cuda(capsys, monkeypatch):
    import gpu_step

    monkeypatch.delenv("MEGATRAIN_FAKE_CUDA", raising=False)
    assert gpu_step.main(["--models", "tiny@64"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_the_fsdp2_peer_wiring_takes_a_step_on_cpu(tmp_path):
    """peers.py's FSDP2 path (fully_shard per block and root, bf16 mixed precision, per-block checkpointing,
    fused AdamW, the eager model's loss) rehearsed with gloo on CPU: one step runs and moves every weight, and
    the row says what ran. CPUOffloadPolicy needs CUDA."""
    out = tmp_path / "peers.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_FAKE_CUDA"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/peers.py"), "--system", "fsdp2", "--case",
                        "tiny@64", "--device", "cpu", "--grad-accum", "2", "--stage", "peer-2-fsdp2", "--out",
                        str(out)], cwd=ROOT, capture_output=True, text=True, env={**env, "MASTER_PORT": "29631"})
    row = json.loads(out.read_text())
    assert r.returncode == 0 and "error" not in row, r.stderr[-2000:]
    assert row["weights_changed"] == row["n_params"] > 0 and row["stage"] == "peer-2-fsdp2"
    assert row["activation_checkpointing"] == "every block" and "fused" in row["optimizer"]
    assert row["status"].startswith("rehearsed: fsdp2 wiring")


def test_a_peer_that_is_not_installed_is_a_row_saying_so(monkeypatch):
    import importlib.util

    import peers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    row = peers.run("deepspeed", "tiny@64", 1, 1, 4)
    assert row["skipped"] == "deepspeed is not installed in this image" and row["seq_len"] == 64


@pytest.mark.parametrize("status", ["failed after 3 s: RuntimeError: Error building extension 'cpu_adam'", None])
def test_deepspeed_runs_only_with_its_cpu_adam_and_says_when_it_could_not_be_built(tmp_path, monkeypatch, status):
    """Timed with torch's AdamW instead, DeepSpeed would look slower than it is: where its CPU Adam did not
    build (or its build did not finish: no status file), the row says so and nothing is timed."""
    import importlib.util

    import peers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "deepspeed" else real(name, *a))
    path = tmp_path / "ds_cpu_adam.txt"
    if status:
        path.write_text(status + "\n")
    row = peers.run("deepspeed", "tiny@64", 1, 1, 4, device="cpu", cpu_adam_status=str(path))
    assert "DeepSpeedCPUAdam is not built" in row["skipped"]
    assert (status or "did not finish").split(":")[0] in row["skipped"]


def test_the_peer_case_is_the_largest_all_three_hold_cut_to_the_time_a_run_has():
    import peers

    fast = {"host_memory_bytes": 120 * GiB, "bf16_matmul_flops": 7e14, "h2d_bytes_per_s": 5e10,
            "first_touch_bytes_per_s": 1e12, "adamw_bytes_per_s": 1e13}
    case, why = peers.choose_case(fast, 10**6)
    assert case == "llama2-7b:27@4096" and "27 blocks (5.7B)" in why  # x 22 B/param fits 120 GiB, 28 blocks do not
    slow = {**fast, "first_touch_bytes_per_s": 5e9, "adamw_bytes_per_s": 2e10}
    small, _ = peers.choose_case(slow, 28)
    assert 1 <= int(small.split(":")[1].split("@")[0]) < 27


def test_the_device_script_runs_every_file_that_holds_cuda_tests():
    script = (ROOT / "benchmarks/gpu/run.sh").read_text()
    listed = set(re.search(r"CUDA_TEST_FILES=\(([^)]*)\)", script).group(1).split())
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "mark.cuda" in p.read_text() and p.name != Path(__file__).name}
    assert marked and listed == marked


@pytest.mark.parametrize("peers", [False, True])
def test_offline_install_takes_what_the_interpreter_lacks_from_the_bundle(tmp_path, monkeypatch, peers):
    """Each distribution of the bundle the interpreter lacks is installed on its own (--no-deps: pip
    --target would install torch again, which the bundle does not carry), DeepSpeed only for the peers."""
    import install_offline

    wh = tmp_path / "bundle"
    wh.mkdir()
    for f in ("pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.whl", "pydantic-2.14.4-py3-none-any.whl",
              "deepspeed-0.19.8-py3-none-any.whl", "torch-2.13.0-cp311-none-any.whl", "rich-15.0.0-py3-none-any.whl"):
        (wh / f).write_bytes(b"")
    monkeypatch.setattr(install_offline, "BUNDLE", wh)
    monkeypatch.setattr(install_offline, "_version", lambda d: "1" if d == "rich" else None)  # rich: present
    calls = []
    monkeypatch.setattr(install_offline.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    install_offline._pip_install(tmp_path / "site", peers)
    (cmd,) = calls
    assert "--no-deps" in cmd and "--no-index" in cmd
    assert cmd[cmd.index(str(tmp_path / "site")) + 1:] == ["deepspeed"] * peers + ["pydantic", "pydantic-core"]


def test_without_pip_the_bundles_wheels_for_this_python_are_unzipped(tmp_path, monkeypatch):
    """An image may come without pip: the wheels it lacks are unzipped into the site, the one for its Python."""
    import importlib.util

    import install_offline

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    _wheel(bundle, "hjson", "hjson")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for py in (tag, "cp99"):
        with zipfile.ZipFile(bundle / f"pydantic_core-2.0-{py}-{py}-manylinux2014_x86_64.whl", "w") as z:
            z.writestr("pydantic_core_marker.py", f"PY = {py!r}\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    monkeypatch.setattr(install_offline, "_version", lambda d: None)
    monkeypatch.setattr(install_offline.subprocess, "run", lambda *a, **kw: pytest.fail("ran pip"))
    install_offline._pip_install(tmp_path / "site", False, bundle)
    assert (tmp_path / "site" / "hjson.py").exists()
    assert (tmp_path / "site" / "pydantic_core_marker.py").read_text() == f"PY = {tag!r}\n"


def test_the_depth_stage_runs_in_the_time_left_within_four_minutes(tmp_path):
    """The depth mixings' throughput (benchmarks/depth_throughput.py) is the last stage, at most 4 minutes, run
    only when the run's budget has DEPTH_MIN_S left and then under the time left; `--depth-only` runs it
    alone; the summary takes its status from the JSON it writes, or says it was cut off."""
    import summary

    assert dict(_stages())["depth-throughput"] <= 240
    assert [n for n, _ in _stages("--depth-only")] == ["bundle", "install", "depth-throughput"]
    script = (ROOT / "benchmarks/gpu/run.sh").read_text()
    call = re.search(r"stage depth-throughput (.*?)\n[^ ]", script, re.S).group(1)
    assert '--limit "$cap"' in call and '--json "$OUT/depth_throughput.json"' in call and "--budget-s" in call
    assert 'DEPTH_ARGS=(--rehearse)' in script and "skipped: $left s left" in script
    f, result = str(tmp_path / "summary.json"), tmp_path / "depth.json"
    summary.main(["init", f, "--mode", "device", "depth-throughput=240"])
    result.write_text(json.dumps({"status": "measured: 14 of 14 runs on H100"}))
    summary.main(["done", f, "depth-throughput", "0", "80", "--json", str(result)])
    assert summary.load(f)["stages"][0]["status"] == "measured: 14 of 14 runs on H100"
    summary.main(["done", f, "depth-throughput", "124", "240", "--json", str(result)])
    assert summary.load(f)["stages"][0]["status"] == "cut off at 240 s (measured: 14 of 14 runs on H100)"
    summary.main(["done", f, "depth-throughput", "1", "3", "--json", str(tmp_path / "none.json")])
    assert summary.load(f)["stages"][0]["status"] == "failed: exit 1 and no result written"
