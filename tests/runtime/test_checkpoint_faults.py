"""NaN and inf in training (on_nan abort and skip, with their checkpoints) and the host-memory check, in
process; Trainers share plans with test_checkpoint.py's (checkpoint_helpers.py)."""

import json
import math

import pytest
import torch
from checkpoint_helpers import SPEC, assert_same_state, make, snapshot

from megatrain.cli import main
from megatrain.runtime import build
from megatrain.runtime.checkpoint import step_dirs
from megatrain.runtime.engine import Engine
from megatrain.runtime.trainer import HostMemoryError, NumericalFault


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


@pytest.fixture()
def nan_at(monkeypatch):
    """Poison the gradients of `unit` in step `step` (1-based) as the device computes them."""
    def arm(step: int, unit: str = "blocks.1") -> None:
        original = Engine._write_grads

        def poisoned(self, u, grad_slot, grads, accumulate):
            original(self, u, grad_slot, grads, accumulate)
            if self.step_index + 1 == step and u.name == unit:
                self.bufs[f"grad{grad_slot}"][: u.flat_numel].fill_(float("nan"))

        monkeypatch.setattr(Engine, "_write_grads", poisoned)
    return arm


# -- NaN and inf --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clip", [None, 1.0])
def test_nan_skip_leaves_state_bit_identical_and_training_goes_on(token_files, tmp_path, nan_at, clip):
    metrics = tmp_path / "m.jsonl"
    with make(token_files, SPEC.replace(clip_norm=clip), on_nan="skip", metrics=metrics) as t:
        t.run(2, progress=False)
        before = snapshot(t.store)
        nan_at(3)
        t.run(1, progress=False)
        assert_same_state(snapshot(t.store), before)  # not one unit stepped, not even the head
        assert [e["step"] for e in t.events] == [3] and "blocks.1" not in t.events[0]["reason"]
        records = t.run(2, progress=False)
        after = snapshot(t.store)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not torch.equal(after["master/blocks.1.mlp.up_proj.weight"], before["master/blocks.1.mlp.up_proj.weight"])
    assert after["step/head.norm.weight"] == before["step/head.norm.weight"] + 2  # AdamW's count skipped step 3
    events = [json.loads(line) for line in metrics.read_text().splitlines() if "event" in line]
    assert [(e["step"], e["event"]) for e in events] == [(3, "skipped")]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nan_abort_keeps_the_last_checkpoint_and_writes_none(token_files, tmp_path, nan_at, clip):
    with make(token_files, SPEC.replace(clip_norm=clip), checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(2, progress=False)
        at_two = snapshot(t.store)
        nan_at(3)
        with pytest.raises(NumericalFault, match=r"^step 3: the gradients .* not finite.*--on-nan abort") as info:
            t.run(4, progress=False)
        state = snapshot(t.store)
    assert str(tmp_path / "step-00000002") in str(info.value)
    assert [s for s, _ in step_dirs(tmp_path)] == [2]
    assert all(torch.isfinite(v).all() for v in state.values())  # no NaN ever reaches the store
    if clip:  # the barrier decides for the whole step before any unit steps
        assert_same_state(state, at_two)
    with make(token_files, SPEC.replace(clip_norm=clip), resume=tmp_path) as t:  # the checkpoint is intact
        assert_same_state(snapshot(t.store), at_two)


def test_nan_loss_aborts_naming_the_step(token_files):
    with make(token_files) as t:
        t.run(1, progress=False)
        t.store.units["head"].master[: 128].fill_(float("nan"))  # the final norm's weight (its next load reads it)
        with pytest.raises(NumericalFault, match=r"^step 2: the loss is nan"):
            t.run(1, progress=False)


def test_cli_nan_abort_and_skip(token_files, tmp_path, nan_at, capsys):
    argv = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
            "--micro-batch", "2", "--dtype", "fp32", "--steps", "4", "--data", str(token_files[0]), "--no-progress",
            "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    nan_at(3)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: step 3: ") and err.count("\n") == 1 and "step-00000002" in err
    assert main([*argv, "--on-nan", "skip", "--checkpoint-dir", str(tmp_path / "ck2")]) == 0
    out, err = capsys.readouterr()
    assert "1 step(s) skipped" in out and "step 3: " in err
    assert [s for s, _ in step_dirs(tmp_path / "ck2")] == [2, 4]


# -- host memory --------------------------------------------------------------------------------------------------
def test_refuses_to_start_without_host_memory(token_files, monkeypatch, capsys):
    monkeypatch.setattr(build, "available_host_bytes", lambda: 1_000_000)
    with pytest.raises(HostMemoryError, match=r"needs .* MiB \(\d[\d,]+ bytes\) .* only 977 KiB \(1,000,000 bytes\)"):
        make(token_files)
    rc = main(["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
               "--steps", "1", "--data", str(token_files[0]), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "1,000,000 bytes" in err
