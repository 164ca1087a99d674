"""CUDA-only branches the streamed runs do not reach, run on the fake CUDA backend: the refusals a GPU machine
can meet (no CUDA, bad GPU delays, no Triton for --compile-units) and the NUMA binding to the GPU's node.
Runs in `make test-cuda-fake`."""

import pytest
import torch

from megatrain import fake_cuda

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not fake_cuda.installed(), reason="the fake CUDA backend (make test-cuda-fake)")]


def test_a_machine_without_cuda_and_bad_gpu_delays_are_refused_in_one_line(monkeypatch):
    from megatrain.runtime.device import CudaDevice, make_device

    with pytest.raises(ValueError, match="gpu_delays must be"):
        CudaDevice(1 << 20, gpu_delays=(5, 1))
    dev = CudaDevice(64 << 20)
    try:
        x = torch.ones(1 << 20, device="cuda")  # 4 MiB at peak
        del x
        dev.reset_peak()  # the allocator's peak with it
        assert torch.cuda.max_memory_allocated() < 4 << 20
    finally:
        dev.close()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="use --device sim"):
        CudaDevice(1 << 20)
    with pytest.raises(ValueError, match="use --device sim"):
        make_device("cuda", budget_bytes=1 << 20)


def test_compile_units_on_cuda_needs_triton(monkeypatch):
    import importlib.util

    from megatrain.runtime.compiled import check_toolchain

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match="needs Triton"):
        check_toolchain("cuda")


def test_the_process_is_bound_to_the_gpus_numa_node(tmp_path, monkeypatch):
    from megatrain.runtime import cpus

    cores = sorted(cpus.os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("binding to a node needs a node with fewer cores than the process has")
    address = cpus.gpu_pci_address(0)
    assert address == "ffff:1b:00.0"  # torch's device properties, as a GPU gives them
    (tmp_path / "bus/pci/devices" / address).mkdir(parents=True)
    (tmp_path / "bus/pci/devices" / address / "numa_node").write_text("1\n")
    (tmp_path / "devices/system/node/node1").mkdir(parents=True)
    (tmp_path / "devices/system/node/node1/cpulist").write_text(f"{cores[-1]}\n")
    bound = []
    monkeypatch.setattr(cpus, "_bind_process", bound.append)
    budget = cpus.resolve("cuda", gpu_index=0, sysfs=tmp_path, bind=True)
    assert bound == [[cores[-1]]] and budget.numa_node == 1 and budget.cores == (cores[-1],)
    assert sum(budget.threads.values()) >= 1


def test_probe_measures_the_gpu_and_writes_a_profile_the_planner_reads(tmp_path, monkeypatch, capsys):
    from megatrain.cli import main
    from megatrain.runtime import machine_probe

    # the GPU's matmul sizes are what make a probe slow on CPU kernels; everything else runs as on a GPU
    monkeypatch.setitem(machine_probe.MATMUL_SIZES, "cuda", {"bfloat16": 64, "float32": 64})
    out = tmp_path / "gpu.json"
    assert main(["probe", "--device", "cuda", "--quick", "--out", str(out)]) == 0
    from megatrain.planner.hardware import Hardware, hardware_preset

    hw = Hardware.model_validate_json(out.read_text())
    assert hw.name.startswith("probed NVIDIA H100") and hw.h2d_bytes_per_s > 0 and hw.d2h_bytes_per_s > 0
    assert hw.peak_flops == hardware_preset("h100-sxm").peak_flops  # the nominal peak of the GPU it names
    assert main(["plan", "--model", "tiny", "--hardware", str(out), "--seq-len", "64", "--gpu-mem", "2GiB"]) == 0
