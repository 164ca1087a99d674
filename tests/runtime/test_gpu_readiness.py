"""CPU twins of the GPU-readiness fixes (issue 16) that have no better home: the metrics' gradient norm is the
step's own, the host threads' CPU budget, and the device memory report. The CUDA halves are in test_cuda.py."""

import time

import pytest
import torch
from runtime_schedules import make_token_files

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.reference import EagerTrainer
from megatrain.runtime.store import HostStore
from megatrain.runtime.trainer import Trainer

TINY = preset("tiny")


def test_the_logged_grad_norm_is_the_steps_own_when_the_host_stream_lags(tmp_path, monkeypatch):
    """Engine.end() waits for the compute stream only; clip_grads runs later on the host stream. The record
    must carry that step's global norm (the eager reference's clip_grad_norm_, to the bit), not the one before."""
    train_file, _ = make_token_files(tmp_path)
    clip = HostStore.clip_grads

    def late_clip(self, *a, **kw):
        time.sleep(0.05)  # the host stream behind the compute, as a slow optimizer makes it on a GPU
        return clip(self, *a, **kw)

    monkeypatch.setattr(HostStore, "clip_grads", late_clip)
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=3e-3, warmup_steps=1,
                      total_steps=6, clip_norm=0.5)
    with Trainer(RunConfig(model=TINY, train=train, gpu_mem=6 * 2**20, data=train_file, device="sim"),
                 delays=(0.0, 0.001)) as t:
        records = t.run(6, progress=False, handle_signals=False)
        batches = [t.batcher.batch(s) for s in range(6)]

    norms = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **kw: norms.append(float(
        clip_grad_norm(*a, **kw))))
    eager = EagerTrainer(TINY, train)
    for b in batches:
        eager.step(b)
    assert [r["grad_norm"] for r in records] == norms
    assert len(set(norms)) == len(norms)  # each step's differs: a lagging read could not pass


def test_grad_norm_of_a_failed_device_raises_instead_of_waiting():
    from runtime_schedules import plans_by_shape

    from megatrain.runtime.engine import Engine
    from megatrain.runtime.stream_device import DeviceError, SimDevice

    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=2, clip_norm=1.0)
    p = next(iter(plans_by_shape(TINY, train, budgets_mib=(64,)).values()))
    with SimDevice(p.gpu_budget_bytes) as dev:
        engine = Engine(p.ir, p.program, dev, HostStore(p.ir, train, program=p.program))
        dev.submit("host", lambda: 1 / 0, "instruction 3 clip_grads()")
        engine.step_index = 1
        with pytest.raises(DeviceError, match="clip_grads"):
            engine.grad_norm()


# -- the CPU budget (item 3) -------------------------------------------------------------------------------------
def test_cpu_lists_and_the_gpus_numa_node_from_sysfs(tmp_path):
    from megatrain.runtime.cpus import numa_cores, parse_cpulist

    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    node = tmp_path / "devices/system/node/node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("8-15\n")
    assert numa_cores("0000:1B:00.0", tmp_path) == (1, list(range(8, 16)))
    (dev / "numa_node").write_text("-1\n")  # a virtual machine that does not say
    assert numa_cores("0000:1b:00.0", tmp_path) == (None, [])
    assert numa_cores("0000:99:00.0", tmp_path) == (None, [])


def test_the_largest_cache_from_sysfs(tmp_path):
    """What host_state.step_rate flushes twice over: the largest of cpu0's caches, None where sysfs says nothing
    readable."""
    from megatrain.runtime.cpus import largest_cache_bytes

    assert largest_cache_bytes(tmp_path) is None
    cache = tmp_path / "devices/system/cpu/cpu0/cache"
    for i, size in enumerate(["48K", "2048K", "491520K", "garbage"]):
        (cache / f"index{i}").mkdir(parents=True)
        (cache / f"index{i}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 491520 * 1024
    (cache / "index4").mkdir()
    (cache / "index4" / "size").write_text("1G\n")
    assert largest_cache_bytes(tmp_path) == 1 << 30


@pytest.mark.parametrize("cores, want", [(16, {"compute": 1, "h2d": 2, "d2h": 1, "comm": 1, "disk": 1, "host": 11}),
                                         (4, {"compute": 1, "h2d": 1, "d2h": 1, "comm": 1, "disk": 1, "host": 1}),
                                         (2, {"compute": 1, "h2d": 1, "d2h": 1, "comm": 1, "disk": 1, "host": 1})])
def test_on_a_gpu_the_host_optimizer_gets_the_cores_the_issuing_threads_leave(cores, want):
    from megatrain.runtime.cpus import thread_budget

    assert thread_budget("cuda", cores) == want
    assert thread_budget("cuda", cores, host_threads=3)["host"] == 3


def test_each_stream_worker_runs_with_its_budgeted_intra_op_threads(monkeypatch):
    from megatrain.runtime.cpus import CpuBudget
    from megatrain.runtime.stream_device import STREAMS, SimDevice

    budget = CpuBudget(cores=(0, 1), threads={"compute": 2, "h2d": 1, "d2h": 1, "comm": 1, "disk": 1, "host": 1})
    seen = {}
    with SimDevice(cpu=budget) as dev:
        for s in STREAMS:
            dev.submit(s, lambda s=s: seen.__setitem__(s, torch.get_num_threads()), "threads")
        dev.synchronize()
    assert seen == {**budget.threads, "disk": 1}  # checkpoint writes: one thread where the budget names none


def test_starting_a_device_leaves_the_callers_and_new_threads_intra_op_count_alone():
    import threading

    from megatrain.runtime.cpus import CpuBudget, resolve
    from megatrain.runtime.stream_device import SimDevice

    before = torch.get_num_threads()
    assert resolve("sim").threads["compute"] == before  # the eager reference's reduction order
    odd = CpuBudget(cores=(0,), threads={"compute": before + 3, "h2d": before + 2, "d2h": before + 1,
                                         "comm": before + 5, "host": before + 4})
    with SimDevice(cpu=odd) as dev:
        assert torch.get_num_threads() == before
        fresh = []
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert fresh == [before]
        seen = []
        dev.submit("host", lambda: seen.append(torch.get_num_threads()), "threads")
        dev.synchronize()
        assert seen == [before + 4]


def test_the_host_thread_count_can_be_set_and_bad_values_are_one_line(monkeypatch):
    from megatrain.runtime.cpus import HOST_THREADS_ENV, resolve

    monkeypatch.setenv(HOST_THREADS_ENV, "3")
    assert resolve("sim").threads["host"] == 3
    monkeypatch.setenv(HOST_THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="MEGATRAIN_HOST_THREADS='lots': expected a positive number"):
        resolve("sim")


# -- the device memory report (item 9) ---------------------------------------------------------------------------
def test_the_allocator_cap_is_a_fraction_of_the_gpu_and_one_it_cannot_hold_is_refused():
    from megatrain.runtime.device import allocator_fraction

    assert allocator_fraction(35 * 2**30, 140 * 2**30) == 0.25
    with pytest.raises(ValueError, match="lower the GPU budget"):
        allocator_fraction(141 * 2**30, 140 * 2**30)
    with pytest.raises(ValueError, match="above the hardware profile's reserved bytes"):
        allocator_fraction(0, 140 * 2**30)


def test_records_compare_measured_memory_with_the_plan_like_with_like(tmp_path, monkeypatch):
    """The process is held to the budget less the plan's reserve, and each measured figure sits beside its
    own plan figure: allocated with buffers + workspace, reserved with the margin added, the GPU's use with
    the reserve too (here a sim device under an h200 profile, its kind read as cuda's for the plan side)."""
    import math

    from megatrain.runtime.stream_device import SimDevice

    limits = []
    monkeypatch.setattr(SimDevice, "limit_allocator", lambda self, n: limits.append(n))
    train_file, _ = make_token_files(tmp_path)
    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=2)
    budget = 2 * 2**30
    with Trainer(RunConfig(model=TINY, train=train, gpu_mem=budget, hardware="h200", data=train_file, device="sim")) as t:
        hw = t.plan.hardware
        assert limits == [budget - hw.reserved_bytes] and hw.reserved_bytes > 0
        rec = t.run(1, progress=False, handle_signals=False)[0]
        assert rec["peak_device_bytes"] == rec["peak_reserved_bytes"] == rec["planned_peak_device_bytes"]
        assert rec["planned_peak_device_bytes"] == t.plan.peak_buffer_bytes and rec["gpu_budget_bytes"] == budget
        assert "planned_peak_gpu_bytes" not in rec  # the sim pool has no reserve or margin to compare
        t.device.kind = "cuda"
        planned = t.planned_memory()
        assert planned["planned_peak_device_bytes"] == t.plan.peak_device_bytes > t.plan.peak_buffer_bytes
        assert planned["planned_peak_reserved_bytes"] == math.ceil(t.plan.peak_device_bytes
                                                                   * (1 + hw.allocator_margin))
        assert planned["planned_peak_gpu_bytes"] == t.plan.peak_gpu_bytes
        t.device.kind = "sim"


def test_events_the_cpu_waits_on_are_blocking(monkeypatch):
    """The staging copies' events are waited on by CPU threads (a reused staging buffer, the next chunk):
    created blocking, so a wait sleeps instead of spinning one of the cores the host optimizer needs."""
    import threading
    from types import SimpleNamespace

    from megatrain.runtime.device import CudaDevice
    from megatrain.runtime.staging import Staging
    from megatrain.runtime.stream_device import SimDevice

    made = []

    class Event:
        def __init__(self, **kw):
            made.append(kw)

        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    staging = Staging(SimDevice())
    staging.cuda = True
    staging._record()
    fake = SimpleNamespace(_cuda_lock=threading.Lock(), _stage_events={})
    src, stage, dst = torch.ones(4), torch.empty(4), torch.empty(4)
    CudaDevice.stage_copy(fake, dst, src, stage)
    CudaDevice.stage_copy(fake, dst, src, stage)  # waits on the first copy's event
    assert len(made) == 3 and all(kw.get("blocking") for kw in made), made
    assert torch.equal(dst, src)


def test_the_cuda_allocator_grows_segments_unless_the_user_configured_it():
    from megatrain.runtime.device import allocator_settings

    assert allocator_settings({}) == "expandable_segments:True"
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is None
