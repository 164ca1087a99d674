"""The offline GPU check rehearsed on CPU (benchmarks/gpu/run.sh, issue 16 item 12): it installs from the tree
with no network and reports "no GPU" cleanly; the CUDA test run fails rather than skips without a GPU; the
GPU benchmark's cases, FLOP count, busy shares and table."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="rehearses the machine without a GPU")


@no_gpu
def test_the_device_script_installs_from_the_tree_and_reports_no_gpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
           "PIP_NO_INDEX": "1"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh")], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert f"{len(packages)} packages linked into" in r.stdout and "no GPU visible" in r.stdout
    assert json.loads((out / "summary.json").read_text())["status"] == "no-gpu"
    assert not list(tmp_path.glob("megatrain-site.*"))  # its install removed on exit


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


@no_gpu
def test_a_cuda_test_run_without_a_gpu_fails_instead_of_skipping_everything(tmp_path):
    from cuda_gate import cuda_run_without_a_gpu

    assert "torch sees no GPU" in cuda_run_without_a_gpu("cuda", {})
    assert "torch sees no GPU" in cuda_run_without_a_gpu("not slow", {"MEGATRAIN_REQUIRE_CUDA": "1"})
    assert cuda_run_without_a_gpu("not slow and not cuda", {}) is None
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "tests/runtime/test_cuda.py"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "every one would be skipped" in r.stdout + r.stderr


def test_benchmark_cases_flops_and_busy_shares():
    import gpu_step

    from megatrain.ir.trace import trace

    cases = [gpu_step.parse_case(c, 4096) for c in gpu_step.DEFAULT_CASES.split(",")]
    assert [(c.name, c.n_layers, s) for c, s in cases] == [("1b", 18, 2048), ("llama2-7b-4L", 4, 4096),
                                                           ("llama2-7b", 32, 4096), ("llama3-8b", 32, 4096)]
    for config, seq in cases[2:]:  # 6 x (every parameter but the input embedding; norms aside) + attention
        n = trace(config, 1, 128, "bf16").params_total - config.vocab_size * config.d_model
        want = 6 * n + 6 * config.n_layers * config.d_model * seq
        assert abs(gpu_step.model_flops_per_token(config, seq) - want) / want < 1e-4
    spans = [("compute", "f", 1, 0.0, 0.6, 0), ("h2d", "l", 1, 0.1, 0.3, 0), ("compute", "b", 1, 0.6, 0.8, 0)]
    assert gpu_step.busy_shares(spans, 1.0) == {"compute": 0.8, "h2d": 0.2}


def test_the_results_table_has_a_row_per_case_with_measured_beside_planned():
    from table import table

    gib = 2**30
    rows = [{"case": "1b@2048", "seq_len": 2048, "tokens_per_s": 12345.6, "model_tflops": 81.2, "mfu": 0.082,
             "measured_step_s": 0.66, "predicted_step_s": 0.5, "peak_device_bytes": 3 * gib,
             "planned_peak_device_bytes": 4 * gib, "peak_reserved_bytes": 5 * gib,
             "planned_peak_reserved_bytes": 6 * gib, "host_rss_bytes": 20 * gib, "host_bytes": 16 * gib,
             "host_policy": "exact", "busy_share": {"compute": 0.5, "host": 0.9}},
            {"case": "llama3-8b", "seq_len": 4096, "skipped": "host state 105.4 GiB > 90% of available"}]
    text = table(rows, "H200")
    assert "| 1b@2048 | 2048 | 12,346 | 81.2 | 8.2% | 0.660 (0.500) | 3.0 (4.0) | 5.0 (6.0) | 20.0 (16.0) | exact " \
           "| host 90% |" in text
    assert "| llama3-8b | 4096 | host state 105.4 GiB > 90% of available |" in text


@no_gpu
def test_the_gpu_benchmark_says_it_measured_nothing_without_cuda(capsys):
    import gpu_step

    assert gpu_step.main(["--models", "1b@2048"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_the_fsdp2_peer_wiring_takes_a_step_on_cpu(tmp_path):
    """peers.py's FSDP2 path (fully_shard per block and root, bf16 mixed precision, the eager model's loss)
    rehearsed with gloo on CPU: one step runs and moves every weight. CPUOffloadPolicy needs CUDA."""
    out = tmp_path / "peers.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/peers.py"), "--system", "fsdp2", "--case",
                        "tiny@64", "--device", "cpu", "--grad-accum", "2", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "MASTER_PORT": "29631"})
    row = json.loads(out.read_text())
    assert r.returncode == 0 and "error" not in row, r.stderr[-2000:]
    assert row["weights_changed"] == row["n_params"] > 0


def test_a_peer_that_is_not_installed_is_a_row_saying_so_and_the_table_gives_the_ratio(monkeypatch):
    import importlib.util

    import peers
    from table import peer_table

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    row = peers.run("deepspeed", "1b@2048", 1, 1, 4)
    assert row["skipped"] == "deepspeed is not installed in this image" and row["seq_len"] == 2048
    ours = [{"case": "1b@2048", "tokens_per_s": 3000.0}]
    theirs = [{"case": "1b@2048", "system": "fsdp2", "tokens_per_s": 1200.0, "model_tflops": 20.0,
               "optimizer": "torch AdamW"}, row]
    text = peer_table(ours, theirs)
    assert "| 1b@2048 | fsdp2 | 1,200 | 2.50x | 20.0 |" in text
    assert "| 1b@2048 | deepspeed | deepspeed is not installed in this image |" in text


def test_the_device_script_runs_every_file_that_holds_cuda_tests():
    import re

    script = (ROOT / "benchmarks/gpu/run.sh").read_text()
    listed = set(re.search(r"CUDA_TEST_FILES=\(([^)]*)\)", script).group(1).split())
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "mark.cuda" in p.read_text() and p.name != Path(__file__).name}
    assert marked and listed == marked


@pytest.mark.parametrize("installed, want", [({"cpu_adam": True}, True), ({"cpu_adam": False}, False), (None, False)])
def test_deepspeeds_cpu_adam_is_used_only_when_prebuilt(monkeypatch, installed, want):
    """Built on first use, DeepSpeedCPUAdam compiles its extension for about a minute, past the case's time
    limit: the peer takes it only when the install has it compiled (ds_report's `installed_ops`)."""
    import types

    import peers

    if installed is None:
        monkeypatch.setitem(sys.modules, "deepspeed.git_version_info", None)  # import fails: not installed
    else:
        monkeypatch.setitem(sys.modules, "deepspeed.git_version_info",
                            types.SimpleNamespace(installed_ops=installed))
    assert peers._cpu_adam_prebuilt() is want


@pytest.mark.parametrize("peers", [False, True])
def test_offline_install_takes_what_the_interpreter_lacks_from_the_wheelhouse(tmp_path, monkeypatch, peers):
    """Each distribution of the wheelhouse the interpreter lacks is installed on its own (--no-deps: pip
    --target would install torch again, which the wheelhouse does not carry), DeepSpeed only for the peers."""
    import install_offline

    wh = tmp_path / "wheelhouse"
    wh.mkdir()
    for f in ("pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.whl", "pydantic-2.14.4-py3-none-any.whl",
              "deepspeed-0.19.8-py3-none-any.whl", "torch-2.13.0-cp311-none-any.whl", "rich-15.0.0-py3-none-any.whl"):
        (wh / f).write_bytes(b"")
    monkeypatch.setattr(install_offline, "WHEELHOUSE", wh)
    monkeypatch.setattr(install_offline, "_version", lambda d: "1" if d == "rich" else None)  # rich: present
    calls = []
    monkeypatch.setattr(install_offline.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    install_offline._pip_install(tmp_path / "site", peers)
    (cmd,) = calls
    assert "--no-deps" in cmd and "--no-index" in cmd
    assert cmd[cmd.index(str(tmp_path / "site")) + 1:] == ["deepspeed"] * peers + ["pydantic", "pydantic-core"]
