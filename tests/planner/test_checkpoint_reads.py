"""The resume step (planner/checkpoint_reads.py): the verifier accepts it and rejects hand-broken ones, it is the
step program plus its reads, units read in the order the step first needs them, and the plan prices it."""

import json
import re

import pytest
from planner_testing import find, without
from program_testing import program_for

from megatrain.ir.program import Instr
from megatrain.planner import ScheduleError, verify
from megatrain.planner.checkpoint_reads import (
    ResumePlanError,
    check_resume_pair,
    loaded_event,
    resume_program,
)
from megatrain.planner.checkpoint_writes import checkpoint_program
from megatrain.planner.schedule import Decisions
from megatrain.planner.synthetic import transformer_ir

IR = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)
TIED = transformer_ir(n_layers=4, micro_batch=1, seq_len=64, tied=True)


def _step(clip=False, ir=IR):
    return program_for(ir, 2, Decisions(2, 2, ("device", "host", "device", "keep", "host", "device")), clip)


def refused(program, pattern: str, ir=IR) -> None:
    """The verifier finds `pattern` among the program's problems (it lists every one)."""
    from megatrain.planner.verify import check

    found = check(program, ir=ir)
    assert any(re.search(pattern, p) for p in found), found


@pytest.mark.parametrize("clip", [False, True])
def test_the_resume_step_verifies_and_is_the_step_plus_its_reads_in_forward_order(clip):
    step = _step(clip)
    first = resume_program(step, IR)
    verify(first, ir=IR)
    assert check_resume_pair(step, first) == []
    loads = [ins.unit for ins in first.instrs if ins.op == "load_state"]
    assert loads == [u.name for u in IR.units]  # the order the loads of the units' weights need them
    # the disk stream comes first, so its records set the device's first step (stream_device.py)
    n = 2 * len(loads)
    assert all(ins.stream == "disk" for ins in first.instrs[:n]) and first.instrs[1].op == "record"
    # each unit's weights load waits for its read, right before it (the h2d stream waits once per unit)
    for unit in loads:
        i = find(first, op="load_params", unit=unit)
        assert first.instrs[i - 1] == Instr(op="wait", stream="h2d", event=loaded_event(unit))
    # the host stream's first touch of the state waits for the last read (the head's: steps go backward)
    host = [ins for _, ins in first.on("host")]
    first_state = next(k for k, ins in enumerate(host) if ins.op in ("optimizer_step", "clip_grads"))
    assert host[first_state - 1] == Instr(op="wait", stream="host", event=loaded_event("head"))


def test_a_reader_racing_its_read_is_refused():
    first = resume_program(_step(), IR)
    i = find(first, op="wait", stream="h2d", event=loaded_event("blocks.1"))
    with pytest.raises(ScheduleError, match=r"load_params\(unit=blocks.1.*may touch blocks.1's host state before "
                                            r".*load_state\(unit=blocks.1\).*missing wait"):
        verify(without(first, i), ir=IR)
    # the host's wait is implied by its optimizer step's own (behind the head's load); without both, both race
    i = find(first, op="wait", stream="host", event=loaded_event("head"))
    verify(without(first, i), ir=IR)
    j = find(first, op="wait", stream="h2d", event=loaded_event("head"))
    refused(without(without(first, i), j), r"optimizer_step\(unit=head.*may touch head's host state")


def test_a_missing_or_doubled_read_is_refused():
    first = resume_program(_step(), IR)
    i = find(first, op="load_state", unit="blocks.2")
    broken = without(without(first, i + 1), i)  # the read and its record; the waits on it now wait on nothing
    refused(broken, r"no load_state\(blocks.2\): the resumed state would miss blocks.2")
    twice = first.replace(instrs=(Instr(op="load_state", stream="disk", unit="embed"), *first.instrs))
    with pytest.raises(ScheduleError, match=r"reads embed a second time"):
        verify(twice, ir=IR)


def test_a_tied_owner_is_read_before_the_unit_that_borrows_it():
    from megatrain.planner.checkpoint_reads import state_units
    from megatrain.planner.sync import tied_owners

    first = resume_program(_step(ir=TIED), TIED)
    verify(first, ir=TIED)
    loads = [ins.unit for ins in first.instrs if ins.op == "load_state"]
    assert loads.index("embed") < loads.index("head")
    units = [u.name for u in TIED.units]
    head = Instr(op="load_params", stream="h2d", unit="head", slot=0)
    assert state_units(head, tied_owners(TIED), units) == ("embed", "head")  # it reads the embedding's master
    assert state_units(head, {}, units) == ("head",)


def test_what_cannot_be_read_while_training_is_refused():
    step = _step()
    with pytest.raises(ResumePlanError, match=r"already has disk instructions"):
        resume_program(checkpoint_program(step), IR)
    with pytest.raises(ResumePlanError, match=r"already has disk instructions"):
        resume_program(resume_program(step, IR), IR)
    assert check_resume_pair(_step(clip=True), resume_program(step, IR))  # another step program
    both = resume_program(step, IR)
    both = both.replace(instrs=(*both.instrs, Instr(op="seal_checkpoint", stream="disk")))
    refused(both, r"both reads and writes a checkpoint")


def test_units_stepped_on_the_device_are_read_before_the_step():
    from megatrain.planner import TrainSpec, plan

    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128, grad_accum=2), "16MiB",
             resident={"embed": "device", "blocks.0": "device"})
    first = resume_program(p.program, p.ir)
    verify(first, ir=p.ir)
    loads = [ins.unit for ins in first.instrs if ins.op == "load_state"]
    assert loads == [u.name for u in ir.units[2:]]
    extra = first.replace(instrs=(Instr(op="load_state", stream="disk", unit="embed"), *first.instrs))
    with pytest.raises(ScheduleError, match=r"reads embed, whose state lives on the device"):
        verify(extra, ir=p.ir)


def test_the_plan_prices_a_resume_streamed_against_read_first():
    from megatrain.planner import TrainSpec, hardware_preset, plan
    from megatrain.planner.checkpoint_reads import resume_cost
    from megatrain.planner.checkpoint_writes import checkpoint_bytes

    spec = TrainSpec(micro_batch=2, seq_len=128, grad_accum=2)
    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    hw = hardware_preset("cpu")
    fast, slow = (plan(ir, hw.replace(disk_read_bytes_per_s=bw, disk_file_latency_s=0.0), spec, 16 * 2**20)
                  for bw in (1e12, 1e6))
    a, b = resume_cost(fast), resume_cost(slow)
    assert a.bytes == b.bytes == checkpoint_bytes(ir, "exact") and a.before_bytes == 0
    assert b.read_s == pytest.approx(b.bytes / 1e6, rel=1e-3)
    # a slow disk: streaming hides the step behind the reads (never slower than reading first, and faster by
    # about the step where the reads dominate); a fast one: the first step is the step
    assert b.synchronous_s - b.read_s == pytest.approx(a.synchronous_s - a.read_s)  # the step itself, read or not
    assert b.streamed_s < b.synchronous_s and b.streamed_s >= b.read_s
    assert a.streamed_s <= 1.01 * a.synchronous_s and a.saved_s >= 0  # (its waits' wake-ups at most)
    line = b.line()
    assert line.startswith("resume: ") and "disk_read_bytes_per_s" in line and "reading everything first" in line


def test_plan_checkpoint_every_prints_the_resume_line(capsys, cached_traces):
    from megatrain.cli import main

    argv = ["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "128", "--micro-batch", "2"]
    assert main([*argv, "--checkpoint-every", "10", "--json"]) == 0
    resume = json.loads(capsys.readouterr().out)["checkpoint"]["resume"]
    assert resume["streamed"] and resume["bytes"] > 0 and resume["disk_bytes_per_s"] == 1e9
    assert resume["first_step_s"] <= 1.01 * resume["first_step_synchronous_s"]
    assert main([*argv, "--checkpoint-every", "3"]) == 0
    out = capsys.readouterr().out
    assert "resume: " in out and "read at 1 GB/s" in out and "while the first step trains" in out
