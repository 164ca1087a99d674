"""The compute-dtype cast at run time (megatrain/runtime/cast.py): each place of megatrain/planner/cast.py feeds the slot the
master's bf16 bits, allocates exactly the host bytes the plan counts, and keeps its bf16 copy current.
Training at each place equals eager mixed precision bit for bit: tests/runtime/test_exactness.py."""

import pytest
import torch
from runtime_schedules import plans_by_shape, with_place

from megatrain.ir.program import Program
from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.planner.report import program_host_breakdown
from megatrain.runtime import cast_kernel
from megatrain.runtime.engine import Engine
from megatrain.runtime.store import HostStore
from megatrain.runtime.stream_device import SimDevice

TINY = preset("tiny")
TRAIN = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="bf16", lr=2e-3, total_steps=3, clip_norm=1.0)


@pytest.fixture(scope="module")
def tiny_plan():
    return next(iter(plans_by_shape(TINY, TRAIN, budgets_mib=(8,)).values()))


def _slot(store, unit, dev) -> torch.Tensor:
    u = store.ir.unit(unit)
    slot = torch.full((u.flat_numel,), float("nan"), dtype=torch.bfloat16)
    store.load_params(unit, slot, dev)
    return slot


@pytest.mark.parametrize("where", ["host", "gpu", "copy"])
def test_each_place_allocates_the_plans_host_bytes_and_loads_the_masters_bits(tiny_plan, where):
    """The store allocates what host_layout counts for the place, component by component (gpu: the masters
    pinned, no staging ring; copy: a bf16 copy of every unit in place of the ring), and a load through the
    engine's buffers puts the master rounded to bf16 in the slot."""
    p = with_place(tiny_plan, where)
    want = program_host_breakdown(p.ir, p.program, "exact")
    with SimDevice(p.gpu_budget_bytes) as dev:
        store = HostStore(p.ir, p.train, program=p.program, device=dev.kind)
        Engine(p.ir, p.program, dev, store)  # binds the gpu place's `cast` buffer
        assert store.feed.where == where
        assert store.host_bytes() == sum(want.values())
        assert store.arena.by_component == {k: v for k, v in want.items() if v}
        assert ("transfer_copy" in want and want["transfer_copy"] > 0) == (where == "copy")
        masters = store.named_master()
        for u in p.ir.units:
            slot = _slot(store, u.name, dev)
            for q in u.params:
                assert torch.equal(slot[q.offset : q.offset + q.numel], masters[f"{u.name}.{q.name}"].reshape(-1)
                                   .to(torch.bfloat16)), (where, u.name, q.name)
        store.close()


def test_the_copy_follows_masters_written_outside_a_step(tiny_plan):
    """The bf16 copy is cast again at the next load after the masters change other than by an optimizer step
    (load_state, a write through named_master or state_tensors, a checkpoint's load)."""
    p = with_place(tiny_plan, "copy")
    with SimDevice() as dev:
        store = HostStore(p.ir, p.train, program=p.program, device=dev.kind)
        unit = p.ir.units[1].name
        before = _slot(store, unit, dev)
        for write in (lambda m: m.mul_(2.0), lambda m: m.add_(1.0)):
            name = next(n for n in store.named_master() if n.startswith(unit + "."))
            write(store.named_master()[name])
            after = _slot(store, unit, dev)
            assert not torch.equal(after, before)
            before = after
        key = next(k for k in store.state_tensors(unit) if k.startswith("master/"))
        store.state_tensors(unit)[key].zero_()
        masters = store.named_master()
        want = torch.cat([masters[f"{unit}.{q.name}"].reshape(-1) for q in p.ir.unit(unit).params])
        assert torch.equal(_slot(store, unit, dev), want.to(torch.bfloat16))
        store.close()


def test_a_device_cast_needs_its_staging_buffer(tiny_plan):
    p = with_place(tiny_plan, "gpu")
    with SimDevice() as dev:
        store = HostStore(p.ir, p.train, program=p.program, device=dev.kind)
        with pytest.raises(RuntimeError, match="no `cast` staging buffer was bound"):
            _slot(store, p.ir.units[0].name, dev)
        store.close()


def test_a_store_without_a_program_casts_on_the_host_and_fp32_casts_nothing(tiny_plan):
    store = HostStore(tiny_plan.ir, TRAIN)
    assert store.cast == "host" and store.feed.where == "host"
    store.close()
    fp32 = plans_by_shape(TINY, TRAIN.replace(dtype="fp32"), budgets_mib=(64,))
    p = next(iter(fp32.values()))
    assert p.program.cast == "none"
    store = HostStore(p.ir, p.train, program=p.program)
    assert store.feed.where == "none" and "transfer_staging" not in store.arena.by_component
    store.close()


def test_the_host_place_casts_through_the_c_cast(tiny_plan, monkeypatch):
    """Device.stage_copy, the host place's cast into the staging ring, runs cast_kernel.cast (the C loop where
    it is built; torch's copy_ otherwise), on the h2d worker's threads."""
    calls = []
    real = cast_kernel.cast

    def counting(src, dst, threads=None):
        calls.append((src.dtype, dst.dtype, torch.get_num_threads()))
        real(src, dst, threads)

    monkeypatch.setattr(cast_kernel, "cast", counting)
    with SimDevice() as dev:
        store = HostStore(tiny_plan.ir, TRAIN, program=tiny_plan.program, device=dev.kind)
        done = []
        dev.submit("h2d", lambda: done.append(_slot(store, tiny_plan.ir.units[1].name, dev)), "load")
        dev.synchronize()
        assert calls and all(c[:2] == (torch.float32, torch.bfloat16) for c in calls)
        assert {c[2] for c in calls} == {dev.cpu.threads["h2d"]}
        store.close()


def test_a_program_names_only_known_places():
    with pytest.raises(ValueError, match="cast"):
        Program(n_micro_batches=1, buffers=(), instrs=(), cast="disk")
