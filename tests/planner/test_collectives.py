"""Data parallelism in the planner: the world's layout, the collectives pass, their costs, the verifier's
checks of them, per-rank host bytes and the scaling table."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testing import find, model_irs, without

from megatrain.planner import ScheduleError, TrainSpec, check, hardware_preset, plan, verify
from megatrain.planner.collectives import collective_seconds
from megatrain.planner.host_policy import host_layout
from megatrain.planner.residency import device_state_bytes
from megatrain.planner.scaling import scaling, worlds
from megatrain.planner.synthetic import transformer_ir
from megatrain.planner.world import (
    World,
    rank_ir,
    replicated_units,
    shard_slices,
    slice_start,
    world_ir,
)

IR = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)
TRAIN = TrainSpec(micro_batch=1, seq_len=64, grad_accum=4)
HW = hardware_preset("h100-sxm")


@settings(max_examples=40, deadline=None)
@given(model_irs(), st.integers(1, 9))
def test_shards_cover_every_parameter_once(ir, nproc):
    """Across the ranks, the slices of a unit are its parameters, element for element, each once."""
    padded = world_ir(ir, nproc)
    for u in padded.units:
        assert u.flat_numel % nproc == 0 and u.flat_numel >= ir.unit(u.name).flat_numel
        assert u.flat_numel - ir.unit(u.name).flat_numel < nproc * 32 or nproc == 1
        covered = {p.name: [] for p in u.params}
        for r in range(nproc):
            S = u.flat_numel // nproc
            for piece in shard_slices(u, nproc, r):
                start = slice_start(u, nproc, r, piece)
                p = next(q for q in u.params if q.name == piece.name)
                assert p.offset + start == r * S + piece.offset  # where it sits in the flat buffer
                assert 0 <= piece.offset and piece.offset + piece.numel <= S
                covered[piece.name].append((start, start + piece.numel))
        for p in u.params:
            spans = sorted(covered[p.name])
            assert spans[0][0] == 0 and spans[-1][1] == p.numel
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_rank_host_bytes_add_up_to_the_state():
    """Each rank's state is a 1/R share of the sharded units (plus per-slice counts and the staging ring)."""
    from megatrain.planner.host_policy import POLICIES

    exact = POLICIES["exact"]
    whole = host_layout(IR, exact, list(range(len(IR.units))))
    for nproc in (2, 3, 8):
        padded = world_ir(IR, nproc)
        masters = [host_layout(rank_ir(padded, nproc, r), exact, list(range(len(IR.units))))["master_fp32"]
                   for r in range(nproc)]
        assert len(set(masters)) == 1  # equal shards
        assert sum(masters) == sum(4 * u.flat_numel for u in padded.units)
        assert sum(masters) - whole["master_fp32"] < 4 * nproc * 32 * len(IR.units)


def test_a_world_plan_shards_loads_and_stores():
    one = plan(IR, HW, TRAIN, "8GiB")
    p = plan(IR, HW, TRAIN, "8GiB", world=World(nproc=4))
    instrs = p.program.instrs
    assert p.program.world_size == 4 and p.program.n_micro_batches == 1 and p.train.grad_accum == 4
    units = [u.name for u in IR.units]
    assert sorted(i.unit for i in instrs if i.op == "reduce_scatter") == sorted(units)
    assert {i.unit for i in instrs if i.op == "all_gather"} == set(units)
    assert all(i.shard for i in instrs if i.op in ("load_params", "store_grads"))
    assert not any(i.norm for i in instrs if i.op == "backward")
    assert all(i.stream == "comm" for i in instrs if i.op in ("all_gather", "reduce_scatter"))
    # the host holds about a quarter of the state per rank, the node all of it
    assert len(p.host_bytes_per_rank) == 4 and p.host_bytes == max(p.host_bytes_per_rank)
    assert abs(p.host_bytes_per_node - one.host_bytes) / one.host_bytes < 0.05
    assert p.host_bytes < one.host_bytes / 3
    assert p.collectives_s > 0 and p.tokens_per_s > 0
    assert "collectives" in p.critical_path_s
    # [collectives] is recorded only for a world
    assert "collectives" in [r.name for r in p.passes] and "collectives" not in [r.name for r in one.passes]


def test_tied_units_are_replicated_and_all_reduced():
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=64, tied=True)
    assert replicated_units(ir) == {"embed", "head"}
    p = plan(ir, HW, TRAIN.replace(grad_accum=2), "8GiB", world=World(nproc=2))
    instrs = p.program.instrs
    assert sorted(i.unit for i in instrs if i.op == "all_reduce") == ["embed", "head"]
    assert not any(i.shard for i in instrs if i.unit in ("embed", "head") and i.op in ("load_params", "store_grads"))
    assert {i.unit for i in instrs if i.op == "all_gather"} == {"blocks.0", "blocks.1"}


def test_collective_costs_follow_the_ring_model():
    nbytes = 1e9
    one_node = collective_seconds(nbytes, World(nproc=8), HW)
    assert one_node == pytest.approx(7 / 8 * nbytes / HW.intra_node_bytes_per_s + HW.collective_latency_s)
    two = collective_seconds(nbytes, World(nproc=16, nnodes=2), HW)
    assert two == pytest.approx(7 / 8 * nbytes / HW.intra_node_bytes_per_s
                                + 1 / 2 * nbytes / 8 / HW.inter_node_bytes_per_s + HW.collective_latency_s)
    assert collective_seconds(nbytes, World(nproc=8), HW, passes=2) == pytest.approx(2 * one_node)


def test_a_slow_interconnect_makes_collectives_the_bottleneck():
    slow = HW.replace(intra_node_bytes_per_s=2e8, name="slow-links")
    p = plan(IR, slow, TRAIN.replace(grad_accum=8), "8GiB", world=World(nproc=8))
    assert p.bottleneck == "collectives"
    fast = plan(IR, HW, TRAIN.replace(grad_accum=8), "8GiB", world=World(nproc=8))
    assert fast.bottleneck != "collectives" and fast.step_time_s < p.step_time_s


def test_the_scaling_table():
    world = World(nproc=8)
    assert [w.nproc for w in worlds(world)] == [1, 2, 4, 8]
    assert [(w.nproc, w.nnodes) for w in worlds(World(nproc=16, nnodes=2))] == [(1, 1), (2, 1), (4, 1), (8, 1),
                                                                                (16, 2)]
    rows = scaling(IR, HW, TRAIN.replace(grad_accum=8), HW.gpu_memory_bytes, world)
    assert [r["nproc"] for r in rows] == [1, 2, 4, 8]
    assert rows[0]["speedup"] == 1 and all(0 < r["efficiency"] <= 1.0 + 1e-9 for r in rows)
    assert rows[-1]["host_bytes_per_rank"] < rows[0]["host_bytes_per_rank"] / 4
    assert all(r["strong_step_time_s"] > 0 for r in rows)


@pytest.mark.parametrize("make, message", [
    (lambda: plan(IR, HW, TRAIN.replace(grad_accum=3), "8GiB", world=World(nproc=2)),
     "--grad-accum 3 is not a multiple of --nproc 2: the global step.s micro-batches .* use --grad-accum 4, or a "
     r"number of ranks that divides 3 \(1, 3;"),
    (lambda: World(nproc=6, nnodes=4), "--nproc 6 is not a multiple of --nnodes 4"),
    (lambda: plan(IR, HW.replace(intra_node_bytes_per_s=None), TRAIN, "8GiB", world=World(nproc=2)),
     "has no intra_node_bytes_per_s"),
])
def test_bad_worlds_are_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _world_program():
    return plan(IR, HW, TRAIN.replace(grad_accum=2), "8GiB", world=World(nproc=2)).program


def test_world_programs_verify_and_broken_ones_do_not():
    p = _world_program()
    assert check(p) == []
    # a forward that may run before the all_gather completed its slot
    i = find(p, op="wait", stream="compute", event="gathered.blocks.1")
    with pytest.raises(ScheduleError, match=r"forward\(unit=blocks.1.*may run before") as err:
        verify(without(p, i))
    assert any("forward(unit=blocks.1" in m and "all_gather(unit=blocks.1" in m and "missing wait" in m
               for m in err.value.problems)
    # a store that may run before the reduce_scatter of its unit
    j = find(p, op="wait", stream="d2h", event="reduced.blocks.2")
    assert any("store_grads(unit=blocks.2" in m and "reduce_scatter" in m for m in check(without(p, j)))


def test_the_verifier_checks_shard_flags_norms_and_gradient_collectives():
    p = _world_program()
    instrs = list(p.instrs)
    k = next(i for i, ins in enumerate(instrs) if ins.op == "load_params" and ins.unit == "blocks.0")
    bad = p.replace(instrs=tuple(ins.replace(shard=False) if i == k else ins for i, ins in enumerate(instrs)))
    assert any("a whole load, so blocks.0 must load its shard" in m for m in check(bad))
    b = next(i for i, ins in enumerate(instrs) if ins.op == "backward" and ins.unit == "head")
    bad = p.replace(instrs=tuple(ins.replace(norm=True) if i == b else ins for i, ins in enumerate(instrs)))
    assert any("writes norms, but in a world program the gradient collective does" in m for m in check(bad))
    r = next(i for i, ins in enumerate(instrs) if ins.op == "reduce_scatter" and ins.unit == "embed")
    bad = p.replace(instrs=tuple(ins.replace(op="all_reduce") if i == r else ins for i, ins in enumerate(instrs)))
    assert any("embed is sharded, so its gradients need reduce_scatter" in m for m in check(bad))
    gone = p.replace(instrs=tuple(ins for i, ins in enumerate(instrs) if i != r))
    assert any("unit embed has 0 gradient collectives" in m for m in check(gone))
    one = p.replace(world_size=1)
    assert any("world_size is 1" in m for m in check(one))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_resident_units_in_a_world(clip):
    """A device unit: reduce_scatter before its store_norms, its device step on the rank's shard, all_gather of
    its slot after; its dstate the most any rank's shard holds. A weights unit: one shard load and all_gather a
    step. Orders that break those rules fail verification."""
    ir = transformer_ir(n_layers=3, micro_batch=1, seq_len=64, target="cpu")
    mapping = {"blocks.0": "device", "blocks.1": "weights", "head": "device"}
    p = plan(ir, "cpu", TRAIN.replace(grad_accum=2, clip_norm=clip), "64MiB", world=World(nproc=2),
             resident=mapping, host_policy="exact")
    instrs = p.program.instrs
    assert check(p.program, ir=p.ir) == [] and p.resident_units == ("blocks.0", "blocks.1", "head")
    at = {(ins.op, ins.unit): i for i, ins in enumerate(instrs)}
    for u in ("blocks.0", "head"):
        assert at["reduce_scatter", u] < at["store_norms", u] < at["device_step", u] < at["all_gather", u]
        ranks = [device_state_bytes(rank_ir(p.ir, 2, r).unit(u), "exact", p.ir.dtype) for r in range(2)]
        assert p.program.buffer(f"dstate.{u}").nbytes == max(ranks)
        assert ranks[0] < device_state_bytes(p.ir.unit(u), "exact", p.ir.dtype) * 0.6  # a shard's
    assert [i.unit for i in instrs if i.op == "load_params"].count("blocks.1") == 1
    assert any("stepped on the device" in line for r in p.passes if r.name == "collectives" for line in r.decisions)
    g = at["all_gather", "blocks.0"]
    gone = p.program.replace(instrs=tuple(ins for i, ins in enumerate(instrs) if i != g))
    assert any("needs an all_gather after it" in m for m in check(gone))
    if clip is not None:  # the device steps wait for clip_grads, which waits for every store_norms
        return
    w = find(p.program, op="wait", stream="compute", event="reduced.head")
    assert any("device_step(unit=head" in m and "reduce_scatter" in m for m in check(without(p.program, w)))


def test_one_rank_plans_are_unchanged_by_the_world():
    a, b = plan(IR, HW, TRAIN, "8GiB"), plan(IR, HW, TRAIN, "8GiB", world=World(nproc=1))
    assert a.program == b.program and a.host_bytes == b.host_bytes and a.host_bytes_per_rank == (a.host_bytes,)
    assert math.isclose(a.step_time_s, b.step_time_s)


def test_plan_cli_prints_the_world_and_its_scaling(capsys):
    """`megatrain plan --nproc 4`: one rank's plan, per-rank and per-node host bytes, the scaling table; --json
    holds the same; a --grad-accum the ranks do not split is refused in one line, and so is `train --nproc 2`
    outside torchrun."""
    import json

    from megatrain.cli import main

    argv = ["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--micro-batch", "2", "--gpu-mem",
            "6MiB", "--grad-accum", "4", "--nproc", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "world 4 rank(s) on 1 node" in out and "predicted scaling" in out and "host/rank" in out
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["world"]["host_bytes_per_rank"]) == 4 and d["host_bytes"] == max(d["world"]["host_bytes_per_rank"])
    assert sum(d["world"]["host_bytes_per_rank"]) <= d["world"]["host_bytes_per_node"]
    assert [r["nproc"] for r in d["scaling"]] == [1, 2, 4]
    assert main([*argv[:-3], "3", "--nproc", "2"]) == 2
    assert "--grad-accum 3 is not a multiple of --nproc 2" in capsys.readouterr().err
    train = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--steps", "1",
             "--nproc", "2"]
    assert main(train) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "launch them with torchrun" in line
