"""The checkpointing step (planner/checkpoint_writes.py): the verifier accepts it and rejects hand-broken ones,
it is the step program plus its writes, and the plan prices it at the disk's bandwidth."""

import json
import math

import pytest
from planner_testing import find, without
from program_testing import program_for

from megatrain.planner import ScheduleError, verify
from megatrain.planner.checkpoint_writes import (
    CheckpointPlanError,
    check_pair,
    checkpoint_bytes,
    checkpoint_program,
)
from megatrain.planner.schedule import Decisions
from megatrain.planner.synthetic import transformer_ir

IR = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)


def _step(clip=False, S=2):
    return program_for(IR, 2, Decisions(S, 2, ("device", "host", "device", "keep", "host", "device")), clip)


@pytest.mark.parametrize("clip", [False, True])
def test_the_checkpointing_step_verifies_and_is_the_step_plus_its_writes(clip):
    step = _step(clip)
    ck = checkpoint_program(step)
    verify(ck, ir=IR)
    assert check_pair(step, ck) == []
    saves = [ins.unit for ins in ck.instrs if ins.op == "save_state"]
    assert saves == [ins.unit for ins in step.instrs if ins.op == "optimizer_step"]  # the optimizer's order
    assert [ins.op for _, ins in ck.on("disk") if ins.op not in ("record", "wait")][-1] == "seal_checkpoint"


def test_a_write_racing_the_update_is_refused():
    ck = checkpoint_program(_step())
    i = find(ck, op="wait", stream="host", event="ckpt.saved.blocks.1")
    with pytest.raises(ScheduleError, match=r"optimizer_step\(unit=blocks.1.*may update blocks.1 before "
                                            r".*save_state\(unit=blocks.1\).*missing wait"):
        verify(without(ck, i))
    i = find(ck, op="save_state", unit="head") - 1  # the wait for the previous step's update of the head
    assert ck.instrs[i].op == "wait" and ck.instrs[i].stream == "disk"
    with pytest.raises(ScheduleError, match=r"save_state\(unit=head\).*before the previous step's optimizer_step"):
        verify(without(ck, i))


def test_a_checkpoint_missing_a_unit_or_its_seal_is_refused():
    ck = checkpoint_program(_step())
    i = find(ck, op="save_state", unit="embed")
    with pytest.raises(ScheduleError, match=r"optimizer_step\(embed\) has no save_state"):
        verify(without(ck, i))
    i = find(ck, op="seal_checkpoint")
    with pytest.raises(ScheduleError, match=r"one seal_checkpoint"):
        verify(without(ck, i))


def test_the_pair_must_agree():
    step = _step()
    assert check_pair(_step(clip=True), checkpoint_program(step))  # another step program
    with pytest.raises(CheckpointPlanError, match=r"already writes"):
        checkpoint_program(checkpoint_program(step))


def test_the_plan_prices_a_checkpoint_at_the_disk_bandwidth():
    from megatrain.planner import TrainSpec, hardware_preset, plan
    from megatrain.planner.checkpoint_writes import checkpoint_cost

    spec = TrainSpec(micro_batch=2, seq_len=128, grad_accum=2)
    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    hw = hardware_preset("cpu")
    fast, slow = (plan(ir, hw.replace(disk_write_bytes_per_s=bw, disk_file_latency_s=lat), spec, 16 * 2**20)
                  for bw, lat in ((1e12, 0.0), (1e6, 1e-3)))
    a, b = checkpoint_cost(fast), checkpoint_cost(slow)
    assert a.bytes == b.bytes == checkpoint_bytes(ir, "exact")
    assert a.extra_s < 0.05 * a.step_s and a.check(1) is None  # a fast disk costs (almost) nothing
    assert b.write_s > a.bytes / 1e6 and b.extra_s > 0.5 * b.write_s  # a slow one holds the optimizer back
    line = b.check(3)
    assert line.startswith("warning: a checkpoint's writes take") and "--checkpoint-every" in line
    assert "1e+06" in " ".join(b.lines()) or "0.001 GB/s" in " ".join(b.lines())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_units_stepped_on_the_device_are_written_on_the_compute_streams_order(clip):
    from megatrain.planner import TrainSpec, plan

    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128, grad_accum=2, clip_norm=clip), "16MiB",
             resident={"embed": "device", "blocks.0": "device"})
    ck = checkpoint_program(p.program)
    verify(ck, ir=p.ir)
    assert check_pair(p.program, ck) == []
    saves = [ins.unit for ins in ck.instrs if ins.op == "save_state"]
    assert set(saves[:2]) == {"embed", "blocks.0"} and len(saves) == len(ir.units)  # the compute stream's first
    i = find(ck, op="wait", stream="compute", event="ckpt.saved.embed")
    assert ck.instrs[i + 1].op == "device_step"
    with pytest.raises(ScheduleError, match=r"device_step\(unit=embed.*may update embed before"):
        verify(without(ck, i))
    i = find(ck, op="save_state", unit=saves[0]) - 1
    assert ck.instrs[i].op == "wait" and ck.instrs[i].stream == "disk"
    with pytest.raises(ScheduleError, match=r"before the previous step's device_step"):
        verify(without(ck, i))


def test_plan_checkpoint_every_prices_a_checkpoint_and_refuses_a_bad_count(capsys, cached_traces):
    from megatrain.cli import main

    argv = ["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "128", "--micro-batch", "2"]
    assert main([*argv, "--checkpoint-every", "10", "--json"]) == 0
    ck = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ck["streamed"] and ck["every"] == 10 and ck["bytes"] > 0 and ck["disk_bytes_per_s"] == 1e9
    assert ck["per_step_s"] == pytest.approx(ck["extra_s"] / 10) and ck["warning"] is None
    assert main([*argv, "--checkpoint-every", "3"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: " in out and "written at 1 GB/s" in out and "--checkpoint-every 3: +" in out
    for bad in ("0", "\uff11\uff10", "x"):
        assert main([*argv, "--checkpoint-every", bad]) == 2
    assert "expected a whole number of steps >= 1" in capsys.readouterr().err


def test_in_a_world_a_checkpoint_is_priced_at_the_busiest_ranks_files_on_its_nodes_disk():
    """Each rank writes its shards and rank 0 the replicated units whole (runtime/checkpoint_stream.py): the
    price is rank 0's bytes, written through a disk the node's ranks share; a resume's reads alike."""
    from megatrain.planner import TrainSpec, hardware_preset, plan
    from megatrain.planner.checkpoint_writes import checkpoint_cost
    from megatrain.planner.collectives import cost_model
    from megatrain.planner.world import World, replicated_units

    ir = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)
    hw = hardware_preset("h100-sxm")
    one = checkpoint_cost(plan(ir, hw, TrainSpec(micro_batch=1, seq_len=64, grad_accum=4), "8GiB"))
    for nproc, nnodes in ((4, 1), (4, 2)):
        world = World(nproc=nproc, nnodes=nnodes)
        p = plan(ir, hw, TrainSpec(micro_batch=1, seq_len=64, grad_accum=4), "8GiB", world=world)
        cost = checkpoint_cost(p)
        whole = replicated_units(p.ir)
        assert cost.bytes < one.bytes  # shards, not the model
        assert f"on rank 0 of {nproc} (its shards" in cost.lines()[0]
        assert (f"shared by a node's {nproc // nnodes} ranks" in cost.lines()[0]) == (nproc // nnodes > 1)
        # rank 0's files: a shard of each sharded unit, the replicated ones whole
        costs = cost_model(p.ir, hw, p.host_policy, False, world)
        for u, b, full in zip(p.ir.units, costs.save_bytes, _whole_file_bytes(p.ir)):
            assert b == (full if u.name in whole else math.ceil(full / nproc))
        # a node's ranks share its disk: a unit's write takes L times its bytes' time at the disk's rate
        L = world.ranks_per_node
        i = next(k for k, u in enumerate(p.ir.units) if u.name not in whole)
        assert costs.save[i] == pytest.approx(costs.save_bytes[i] * L / hw.disk_write_bytes_per_s + hw.disk_file_latency_s)
        assert costs.read[i] == pytest.approx(costs.save_bytes[i] * L / hw.disk_read_bytes_per_s + hw.disk_file_latency_s)


def _whole_file_bytes(ir):
    """The unit files' whole bytes, as the one-process cost model counts them."""
    from megatrain.planner.costs import unit_file_bytes

    return [unit_file_bytes(u, "exact") for u in ir.units]
