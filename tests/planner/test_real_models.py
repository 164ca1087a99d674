"""Real presets through the planner: llama3-70b on an H100 at 8k context, dense-120b on an H200, and the
1 GiB budget that cannot work."""

import json
import time

import pytest
from planner_testing import traced

from megatrain.cli import main
from megatrain.planner import InfeasiblePlanError, TrainSpec, hardware_preset, plan

TRAIN_8K = TrainSpec(micro_batch=1, seq_len=8192)


def test_llama3_70b_on_h100_fits_and_respects_physics(ir70):
    hw = hardware_preset("h100-sxm")
    p = plan(ir70, hw, TRAIN_8K, "80GiB")
    assert p.feasible and p.peak_gpu_bytes <= 80 * 2**30
    params = ir70.params_total
    host_ckpt = sum(u.carry_in_bytes + (u.replay_bytes if pu.replay else 0)
                    for u, pu in zip(ir70.units, p.units) if p.placement[u.name] == "host")
    assert p.host_breakdown["checkpoints"] == host_ckpt
    # the exact host policy: 12 B/param of fp32 master and moments (untied, no padding), no transfer copy; the
    # gradients only of units still waiting for their step, each buffer at the fp32 size of its largest unit:
    # a ring the units stepped as they land take turns in, and one per unit stepped after the backward
    hb = p.host_breakdown
    assert p.host_policy == "exact" and hb["master_fp32"] + hb["moments"] == 12 * params
    steps = {i.unit: i.host_grad for i in p.program.instrs if i.op == "optimizer_step"}
    last_store = max(k for k, i in enumerate(p.program.instrs) if i.op == "store_grads")
    waiting = [i.unit for k, i in enumerate(p.program.instrs) if i.op == "optimizer_step" and k > last_store]
    users = {k: [u for u, j in steps.items() if j == k] for k in set(steps.values())}
    assert waiting and all(users[steps[u]] == [u] for u in waiting)  # a buffer of its own while it waits
    assert {k for k, us in users.items() if not set(us) & set(waiting)}  # the others step from the ring
    sizes = {u.name: 4 * u.flat_numel for u in ir70.units}
    assert hb["grads"] == sum(max(sizes[u] for u in us) for us in users.values())
    # the compute-dtype cast (megatrain/planner/cast.py): with the host optimizer the bottleneck, the link fed from a bf16
    # copy the optimizer writes (2 B/param) beats a host cast into the staging ring (2 x 16M bf16)
    assert p.cast == "copy" and p.cast_step_s["copy"] < p.cast_step_s["host"]
    assert hb["transfer_copy"] == 2 * params and hb["transfer_staging"] == 0
    assert hb["step_counts"] == 4 * sum(len(u.params) for u in ir70.units)
    assert p.host_bytes == sum(hb.values()) and hb["pinned_alignment"] < 2 * 4096 + 64 * (len(hb) + len(waiting))
    tokens = 8192
    compute_bound = tokens / (sum(u.flops_fwd + u.flops_bwd for u in ir70.units) / hw.flops("bfloat16"))
    flat = sum(u.flat_numel for u in ir70.units)
    link_bound = tokens / max(flat * 2 / hw.h2d_bytes_per_s, flat * 4 / hw.d2h_bytes_per_s)
    assert p.tokens_per_s <= compute_bound and p.tokens_per_s <= link_bound
    assert p.step_time_s >= sum(u.optimizer_s for u in p.units)  # the host must step every unit each step


def test_1gib_names_the_smallest_budget(ir70):
    with pytest.raises(InfeasiblePlanError) as err:
        plan(ir70, "h100-sxm", TRAIN_8K, "1GiB")
    e = err.value
    assert e.kind == "gpu" and "\n" not in str(e) and "smallest workable budget" in str(e)
    assert plan(ir70, "h100-sxm", TRAIN_8K, e.needed_bytes).peak_gpu_bytes <= e.needed_bytes
    with pytest.raises(InfeasiblePlanError):
        plan(ir70, "h100-sxm", TRAIN_8K, e.needed_bytes - 1)


def test_cli_json_and_infeasible_exit_code(capsys, ir70, cached_traces):
    argv = ["plan", "--model", "llama3-70b", "--hardware", "h100-sxm", "--seq-len", "8192", "--micro-batch", "1"]
    assert main(argv + ["--gpu-mem", "80GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("feasible", "peak_gpu_bytes", "gpu_budget_bytes", "host_bytes", "step_time_s", "tokens_per_s",
                "bottleneck", "units"):
        assert key in out
    assert out["feasible"] and out["peak_gpu_bytes"] <= out["gpu_budget_bytes"] == 80 * 2**30
    assert len(out["units"]) == 82
    assert main(argv + ["--gpu-mem", "1GiB"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: GPU budget 1 GiB is too small")
    assert "--gpu-mem" in lines[0] and captured.out == ""


def test_dense_120b_on_h200_plans_fast():
    ir = traced("dense-120b", 1, 8192)
    t = time.perf_counter()
    p = plan(ir, "h200", TRAIN_8K)
    assert time.perf_counter() - t < 3.0  # the benchmark measures it properly; this guards a regression
    assert p.feasible and p.host_bytes <= p.hardware.host_memory_bytes


def test_tiny_plans_on_the_sim_device():
    ir = traced("tiny", 2, 128, target="cpu")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128, grad_accum=2), "8MiB")
    assert p.feasible and p.program.n_micro_batches == 2
