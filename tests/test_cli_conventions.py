"""The command line's conventions (issue 42): flags spelled whole (no prefix matching, on `megatrain` and
`megatrain-vab`), "did you mean" for an unknown flag, verb or preset, byte sizes that spell their unit, one
`--hardware` default (this machine) whose host memory keeps a headroom, and a named preset's host memory shown."""

import contextlib
import io

import pytest

from megatrain.cli import main

TRAIN = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--dtype", "fp32",
         "--no-progress"]


def run(argv, vab=False):
    from megatrain.cli import vab as vab_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = vab_cli.main(argv) if vab else main(argv)
    return rc, out.getvalue(), err.getvalue()


def one_line(rc, err, *needles):
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_a_prefix_of_a_flag_is_refused_naming_the_flag():
    one_line(*run([*TRAIN, "--step", "5"])[::2], "--step 5", "did you mean --steps?")
    one_line(*run([*TRAIN, "--steps", "1", "--warm=2"])[::2], "--warm=2")  # not --warmup, not --warmup-style


def test_megatrain_vab_takes_no_prefix_either(tmp_path):
    one_line(*run(["generate", "--out", str(tmp_path / "t.jsonl"), "--siz", "2"], vab=True)[::2], "--siz",
             "did you mean --sizes?")


@pytest.mark.parametrize("argv, needles", [
    (["trian"], ["invalid choice: 'trian'", "did you mean train?"]),
    (["plan", "--model", "tinyy", "--hardware", "cpu", "--seq-len", "64"], ["'tinyy' (did you mean tiny?)"]),
    (["plan", "--model", "tiny", "--hardware", "h100-sx", "--seq-len", "64"], ["'h100-sx' (did you mean h100-sxm?)"]),
    ([*TRAIN, "--steps", "1", "--device", "simm"], ["did you mean sim?"]),
    ([*TRAIN[:6], "40G", *TRAIN[7:], "--steps", "1"], ["'40G' is ambiguous", "40GiB", "40GB"]),
    (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--host-mem", "1.5T"], ["1.5TiB", "1.5TB"]),
])
def test_unknown_names_get_the_nearest_known_ones(argv, needles):
    one_line(*run(argv)[::2], *needles)


def test_hardware_auto_is_this_machine_and_a_named_preset_shows_its_host_memory(monkeypatch):
    import torch

    from megatrain.runtime.build import hardware_of, machine_host_bytes
    from megatrain.runtime.config import RunConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["plan", "--model", "tiny", "--seq-len", "64", "--gpu-mem", "4GiB"]
    rc, out, _ = run(base)
    assert rc == 0 and "plan tiny on h100-sxm" in out and "note: hardware auto: no GPU here" in out
    rc, out, _ = run([*base, "--hardware", "h100-sxm"])
    assert rc == 0 and "note: host memory 2 TiB: the h100-sxm preset's (pass --host-mem" in out
    rc, out, _ = run([*base, "--hardware", "h100-sxm", "--host-mem", "64GiB"])
    assert rc == 0 and "note:" not in out and "of 64 GiB" in out

    physical = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    here = machine_host_bytes()
    assert here is not None and here <= physical - max(physical // 10, 2 * 2**30) + 1
    settings = {"model": "tiny", "seq-len": 64, "steps": 1, "gpu-mem": "6MiB"}
    assert hardware_of(RunConfig.from_settings(settings), "sim").host_memory_bytes == here  # auto: this machine's
    preset = hardware_of(RunConfig.from_settings({**settings, "hardware": "cpu"}), "sim")
    assert preset.host_memory_bytes == 16 * 2**30  # a preset named keeps its own
    given = hardware_of(RunConfig.from_settings({**settings, "host-mem": "3GiB"}), "sim")
    assert given.host_memory_bytes == 3 * 2**30
