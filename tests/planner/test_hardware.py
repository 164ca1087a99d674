"""Hardware presets, profile files and the reserved-bytes + margin arithmetic."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatrain.planner import HARDWARE_PRESETS, Hardware, hardware_preset, load_hardware, resolve_hardware


@pytest.mark.parametrize("name", ["h100-sxm", "h100-pcie", "h200", "gh200", "a100-80g", "rtx4090", "cpu"])
def test_presets_are_sourced_and_round_trip(name):
    hw = hardware_preset(name)
    assert hw.source and hw.matmul_flops["bfloat16"] > 0 and hw.peak("bfloat16") >= hw.flops("bfloat16")
    assert Hardware.from_json(hw.to_json()) == hw
    assert set(HARDWARE_PRESETS) >= {name}


def test_achievable_is_below_nominal():
    hw = hardware_preset("h100-sxm")
    assert hw.flops("bf16") == pytest.approx(0.75 * 989.4e12)
    assert hw.h2d_bytes_per_s < 64e9 and hw.gpu_memory_bytes == 80 * 2**30
    assert hardware_preset("gh200").h2d_bytes_per_s > 5 * hw.h2d_bytes_per_s  # NVLink-C2C, not PCIe


def test_profile_file(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(hardware_preset("h200").to_json())
    assert load_hardware(path) == hardware_preset("h200")
    assert resolve_hardware(str(path)).name == "h200"


def test_profile_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware 'h900'.*h100-sxm"):
        hardware_preset("h900")
    with pytest.raises(ValueError, match="cannot read a hardware profile"):
        load_hardware(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="gpu_memory_bytes") as err:
        load_hardware(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no matmul rate for float16"):
        hardware_preset("cpu").flops("float16")


@given(st.integers(0, 10**12), st.floats(0, 0.5), st.integers(0, 2**31))
def test_device_bytes_for_inverts_gpu_bytes(budget, margin, reserved):
    hw = hardware_preset("cpu").replace(allocator_margin=margin, reserved_bytes=reserved)
    p = hw.device_bytes_for(budget)
    if budget >= reserved:
        assert hw.gpu_bytes(p) <= budget < hw.gpu_bytes(p + 1)


def test_the_profile_of_a_device_without_one_given(monkeypatch):
    """Trainer(device=...) and `train --hardware auto` plan with the device's own profile: the cpu preset for
    the sim device, the preset a GPU's name matches, else one line asking for `megatrain probe`."""
    import torch

    from megatrain.planner.hardware import hardware_for_device

    assert hardware_for_device("sim").name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, preset in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                         ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA GH200 480GB", "gh200")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert hardware_for_device("cuda").name == preset
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(ValueError, match="no hardware preset matches GPU 'Tesla T4'.*megatrain probe"):
        hardware_for_device("cuda")


def test_auto_device_plans_for_the_device_it_gets_and_a_gpu_by_its_index(monkeypatch):
    """"auto" is what make_device picks: on a machine without a GPU the sim device's `cpu` preset (it raised
    "no hardware preset matches GPU ''"); on several GPUs the one the rank runs on is the one named."""
    import torch

    from megatrain.planner.hardware import hardware_for_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware_for_device("auto").name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {0: "NVIDIA H100 PCIe", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i or 0])
    assert hardware_for_device("auto").name == "h100-pcie"
    assert hardware_for_device("cuda", 1).name == "h200"
