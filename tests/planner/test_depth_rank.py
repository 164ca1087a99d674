"""DepthSSD's rank as a planner decision: `--depth-rank auto|N`, the rank sweep of tune, and the `rebuild`
checkpoint placement that makes large ranks affordable.

The model is the `small` preset at 8 x 1024 tokens on an h100-pcie profile: its rank-16 state is 128 MiB per
unit boundary in fp32, which the budgets below make a real trade against prefetch slots and checkpoints.
"""

import json

import pytest
from planner_testing import traced

from megatrain.cli import main
from megatrain.models import preset
from megatrain.planner import TrainSpec, hardware_preset
from megatrain.planner.depth_rank import choose_rank, rank_config
from megatrain.planner.tune import tune

GIB = 2**30
HW = hardware_preset("h100-pcie")
SMALL = preset("small")
TRAIN = TrainSpec(micro_batch=8, seq_len=1024)


def _trace(config, spec):
    return traced(config, spec.micro_batch, spec.seq_len, spec.dtype, "cuda")


def test_auto_rank_grows_with_the_budget_and_always_fits():
    chosen = []
    for gib in (2, 3, 4, 6, 8):
        c = choose_rank(SMALL, HW, TRAIN, gib * GIB, _trace)
        assert c.plan.peak_gpu_bytes <= gib * GIB and c.plan.feasible
        assert c.plan.ir.config["depth_mixing"] == f"depthssd:{c.rank}"
        ref = [r for r in c.rows if r["rank"] == c.rank][0]
        assert c.rank == 1 or ref["verdict"] == "within tolerance"
        # every larger rank is either infeasible or beyond the tolerance: the choice is the largest allowed
        assert all(not r["feasible"] or r["verdict"] != "within tolerance" for r in c.rows if r["rank"] > c.rank)
        chosen.append(c.rank)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1], chosen


def test_a_tight_budget_makes_depthssd_rebuild_its_carries():
    """At 4 GiB a rank-16 plan keeps sub-layer inputs (16 x smaller) instead of offloading its state."""
    ir = _trace(rank_config(SMALL, 16), TRAIN)
    from megatrain.planner import plan

    p = plan(ir, HW, TRAIN, 4 * GIB)
    rebuilt = [u for u, where in p.placement.items() if where == "rebuild"]
    assert rebuilt, p.placement
    u = ir.unit(rebuilt[0])
    assert u.rebuild_bytes * 16 == u.carry_in_bytes  # 2 sub-layer inputs in bf16 against 16 fp32 copies
    assert "mode=rebuild" in str(p.program) or any(i.mode == "rebuild" for i in p.program.instrs)


def test_plan_cli_says_which_rank_and_why(capsys, cached_traces):
    args = ["plan", "--model", "small", "--hardware", "h100-pcie", "--seq-len", "1024", "--micro-batch", "8",
            "--gpu-mem", "6GiB"]
    # the per-sub-layer state read (chunk=1), whose rank 16 costs more than 5%; --depth-rank keeps the read
    per_layer = [*args, "--depth-mixing", "depthssd:1:chunk=1"]
    assert main([*per_layer, "--depth-rank", "auto"]) == 0
    out = capsys.readouterr().out
    assert "depth rank: N=8, the largest of {1, 2, 4, 8, 16}" in out
    assert "N=16" in out and "beyond 5%" in out
    assert main([*per_layer, "--depth-rank", "auto", "--rank-tolerance", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["depth_rank"]["chosen"] == 16 and len(got["depth_rank"]["ranks"]) == 5
    assert main([*args, "--depth-rank", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "small+depthssd:4"


@pytest.mark.parametrize("extra, message", [
    (["--depth-rank", "auto", "--depth-mixing", "hc:2"], "--depth-rank sets DepthSSD's rank"),
    (["--depth-rank", "0"], "between 1 and 64"),
    (["--depth-rank", "two"], "must be auto or comma-separated integers"),
    (["--depth-rank", "auto", "--rank-tolerance", "-1"], "--rank-tolerance must be >= 0"),
    (["--depth-mixing", "densest"], "unknown depth mixing"),
])
def test_bad_rank_flags_give_one_line(capsys, extra, message):
    args = ["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_tune_sweeps_the_rank_next_to_the_budget(cached_traces):
    result = tune(SMALL, HW, TRAIN, [3 * GIB, 8 * GIB], depth_ranks=[1, 16], trace_fn=lambda m, mb, s: _trace(m, s))
    assert [(r.depth_rank, r.gpu_budget_bytes) for r in result.rows] == [
        (1, 3 * GIB), (1, 8 * GIB), (16, 3 * GIB), (16, 8 * GIB)]
    for rank in (1, 16):  # the front is per rank: each rank's cheapest feasible row is on it
        rows = [r for r in result.rows if r.depth_rank == rank and r.feasible]
        assert rows and rows[0].pareto
    assert main(["tune", "--model", "small", "--hardware", "h100-pcie", "--seq-len", "1024", "--micro-batch", "8",
                 "--gpu-mem", "3GiB,8GiB", "--depth-rank", "1,16", "--json"]) == 0


def test_only_depthssd_blocks_may_rebuild():
    from program_testing import program_for

    from megatrain.planner.schedule import Decisions

    ir = traced("tiny", 1, 64)
    with pytest.raises(ValueError, match="blocks.0 cannot rebuild its carry-in"):
        program_for(ir, 1, Decisions(1, 1, ("device", "rebuild", "host", "host", "host", "host")))
