"""Devices: stream ordering through events (with random delays), cross-step waits, the memory pool and
out-of-memory errors, failures surfacing without deadlock, close and make_device. Each device test runs on
`sim`; the same tests run on `cuda` under the `cuda` marker (`make test-cuda`)."""

import threading
import time

import pytest
import torch

from megatrain.runtime.device import CudaDevice, make_device
from megatrain.runtime.stream_device import DeviceError, DeviceOutOfMemory, MemoryPool, SimDevice

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


def new_device(kind, budget=None, delays=(0.0, 0.002)):
    return SimDevice(budget, delays=delays, seed=1) if kind == "sim" else CudaDevice(budget)


@pytest.fixture(params=["sim", CUDA])
def dev(request):
    device = new_device(request.param)
    yield device
    device.close()


def within(seconds, fn, *args):
    """Run fn on a helper thread; fail the test if it has not returned after `seconds` (a deadlock)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: B036 - re-raised on the test thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {seconds} s (deadlock?)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_cross_stream_ordering_under_random_delays(dev):
    # h2d fills one device buffer per step, compute reads it: `loaded` orders the read after the write, the
    # cross-step wait on `consumed` orders the next write after this read (the buffer is reused).
    n, size = 50, 1024
    buf = dev.empty((size,), torch.float32)
    host = [dev.host_empty((size,), torch.float32).fill_(float(i + 1)) for i in range(n)]
    seen = torch.zeros((n, size), device=dev.torch_device)
    if dev.kind == "cuda":
        torch.cuda.synchronize()  # the zero fill ran on the default stream, which the device's streams don't wait on

    def load(i):
        return lambda: dev.copy(buf, host[i])

    def read(i):
        return lambda: seen[i].copy_(buf * 1.0)

    for step in range(n):
        dev.wait("h2d", "consumed", step - 1)
        dev.submit("h2d", load(step), f"load_params(step={step})")
        dev.record("h2d", "loaded", step)
        dev.wait("compute", "loaded", step)
        dev.submit("compute", read(step), f"forward(step={step})")
        dev.record("compute", "consumed", step)
    within(60, dev.synchronize)
    expected = torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1).expand(n, size)
    assert torch.equal(seen.cpu(), expected)


def test_streams_run_independently_without_waits():
    # The negative control: with no wait, compute does not see what a slow h2d op writes later.
    with SimDevice() as dev:
        value = torch.zeros(1)
        seen = []
        dev.submit("h2d", lambda: (time.sleep(0.2), value.fill_(1.0)), "slow write")
        dev.submit("compute", lambda: seen.append(value.item()), "read")
        within(10, dev.synchronize)
        assert seen == [0.0] and value.item() == 1.0


def test_cross_step_wait_is_a_no_op_at_the_first_step(dev):
    ran = []
    dev.wait("h2d", "optimizer_step.u0", -1)  # step 0's wait on step -1
    dev.submit("h2d", lambda: ran.append("load"), "load_params")
    dev.record("host", "optimizer_step.u0", 0)
    within(10, dev.synchronize)
    assert ran == ["load"] and dev.first_step == 0


def test_resumed_device_starts_at_its_first_step(dev):
    # A run resumed at step 7: its first instruction waits on step 6, which this device never ran.
    ran = []
    dev.wait("h2d", "optimizer_step.u0", 6)
    dev.submit("h2d", lambda: ran.append(7), "load_params")
    within(10, dev.synchronize)
    assert ran == [7] and dev.first_step == 7


def test_wait_blocks_until_its_step_is_recorded(dev):
    ran = threading.Event()
    dev.record("host", "begin", 0)
    dev.record("host", "optimizer_step", 0)
    dev.wait("compute", "optimizer_step", 1)  # next step's record, not yet submitted
    dev.submit("compute", ran.set, "forward")
    time.sleep(0.2)
    assert not ran.is_set()
    dev.record("host", "optimizer_step", 1)
    within(10, dev.synchronize)
    assert ran.is_set()


def test_synchronize_one_stream(dev):
    release = threading.Event()
    dev.submit("host", lambda: release.wait(10), "blocked host op")
    dev.submit("compute", lambda: None, "forward")
    within(5, dev.synchronize, "compute")  # does not wait for the host stream
    release.set()
    within(10, dev.synchronize)


def test_memory_pool_accounting():
    pool = MemoryPool(1000)
    pool.alloc("slot0", 400)
    pool.alloc("carry.block0.0", 500)
    assert (pool.current, pool.peak) == (900, 900)
    pool.free("carry.block0.0")
    assert (pool.current, pool.peak) == (400, 900) and "slot0" in pool and pool.live() == {"slot0": 400}
    pool.reset_peak()
    assert pool.peak == 400
    with pytest.raises(ValueError, match="already allocated"):
        pool.alloc("slot0", 1)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free("carry.block0.0")
    with pytest.raises(DeviceOutOfMemory) as info:
        pool.alloc("saved.block1.0", 601)
    assert str(info.value) == (
        "device out of memory: allocating saved.block1.0 (601 bytes) with 400 of 1000 bytes in use; "
        "raise --gpu-mem or let the planner pick a smaller schedule"
    )
    assert pool.current == 400  # a failed allocation changes nothing
    pool.alloc("saved.block1.0", 600)  # exactly full is fine
    unlimited = MemoryPool(None)
    unlimited.alloc("x", 10**15)
    assert unlimited.peak == 10**15


@pytest.mark.parametrize("kind", ["sim", CUDA])
def test_out_of_memory_in_a_worker_reaches_the_caller(kind):
    with new_device(kind, budget=100) as dev:
        dev.submit("compute", lambda: dev.pool.alloc("carry.block0.0", 64), "forward(block0)")
        dev.submit("compute", lambda: dev.pool.alloc("carry.block1.0", 64), "forward(block1)")
        with pytest.raises(DeviceError, match="forward\\(block1\\)") as info:
            within(10, dev.synchronize)
        assert isinstance(info.value.__cause__, DeviceOutOfMemory)
        assert "device out of memory: allocating carry.block1.0 (64 bytes) with 64 of 100 bytes" in str(info.value)
        if kind == "sim":
            assert dev.measured_peak_bytes() == 64


def test_failure_aborts_waits_and_surfaces_without_deadlock(dev):
    after = []

    def boom():
        raise ValueError("boom")

    dev.record("host", "begin", 0)
    dev.submit("compute", boom, "backward(unit=block3, mb=1)")
    dev.submit("compute", lambda: after.append("compute"), "forward(next)")
    dev.record("compute", "grads_ready", 0)  # never reached: the op before it failed
    dev.wait("d2h", "grads_ready", 0)
    dev.submit("d2h", lambda: after.append("d2h"), "store_grads")
    dev.record("d2h", "stored", 0)
    dev.wait("host", "stored", 0)
    dev.submit("host", lambda: after.append("host"), "optimizer_step")
    with pytest.raises(DeviceError) as info:
        within(10, dev.synchronize)
    message = str(info.value)
    assert "backward(unit=block3, mb=1)" in message and "ValueError: boom" in message
    assert isinstance(info.value.__cause__, ValueError) and info.value.label == "backward(unit=block3, mb=1)"
    assert after == []
    with pytest.raises(DeviceError, match="boom"):
        dev.submit("compute", lambda: None, "later op")
    with pytest.raises(DeviceError, match="boom"):
        within(10, dev.synchronize)  # the device stays failed
    within(10, dev.close)


def test_a_wait_nobody_records_is_reported_as_a_deadlock(dev):
    dev.record("host", "begin", 0)
    dev.wait("compute", "loaded.block2", 0)
    dev.submit("compute", lambda: None, "forward(block2)")
    with pytest.raises(DeviceError, match="deadlock: compute waits for \\(loaded.block2, step 0\\)"):
        within(20, dev.synchronize)


def test_synchronize_inside_a_worker_is_an_error(dev):
    dev.submit("compute", dev.synchronize, "nested synchronize")
    with pytest.raises(DeviceError, match="inside a stream worker"):
        within(10, dev.synchronize)


def test_close_is_idempotent_and_final(dev):
    dev.submit("compute", lambda: None, "forward")
    within(10, dev.synchronize)
    dev.close()
    dev.close()
    with pytest.raises(DeviceError, match="closed"):
        dev.submit("compute", lambda: None, "forward")
    with pytest.raises(DeviceError, match="closed"):
        dev.synchronize()


def test_close_does_not_hang_on_a_blocked_wait():
    dev = SimDevice()
    dev.record("host", "begin", 0)
    dev.wait("compute", "never", 0)
    within(10, dev.close)


def test_bad_arguments():
    with SimDevice() as dev:
        with pytest.raises(ValueError, match="unknown stream 'gpu'"):
            dev.submit("gpu", lambda: None, "x")
        with pytest.raises(TypeError, match="callable"):
            dev.submit("compute", None, "x")
    with pytest.raises(ValueError, match="delays"):
        SimDevice(delays=(0.2, 0.1))
    with pytest.raises(ValueError, match=">= 0"):
        MemoryPool(-1)


def test_sim_device_basics():
    with make_device("sim", 1 << 20, delays=(0.0, 0.001), seed=3) as dev:
        assert dev.kind == "sim" and dev.torch_device == torch.device("cpu") and dev.pool.budget == 1 << 20
        assert dev.STREAMS == ("compute", "h2d", "d2h", "host", "comm", "disk")
        t = dev.empty((2, 3), torch.bfloat16)
        assert t.shape == (2, 3) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
        dev.pool.alloc("a", 10)
        assert dev.measured_peak_bytes() == 10


def test_make_device_errors():
    with pytest.raises(ValueError, match="unknown device kind 'tpu'; valid kinds: sim, cuda, auto"):
        make_device("tpu")
    with make_device("auto") as dev:
        assert dev.kind == ("cuda" if torch.cuda.is_available() else "sim")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_make_device_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available.*--device sim"):
        make_device("cuda")
    with pytest.raises(ValueError, match="--device sim"):
        CudaDevice()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_buffers_are_pinned_and_peak_is_measured():
    with CudaDevice() as dev:
        assert dev.host_empty((4,), torch.float32).is_pinned()
        dev.reset_peak()
        x = []
        dev.submit("compute", lambda: x.append(dev.empty((1 << 20,), torch.float32)), "alloc")
        dev.synchronize()
        assert dev.measured_peak_bytes() >= 4 << 20


class _Counting(SimDevice):
    """A sim device that counts how often the hardware was drained (CUDA's torch.cuda.synchronize)."""

    def __init__(self, *a, **kw):
        self.drains = 0
        super().__init__(*a, **kw)

    def _device_synchronize(self, stream):
        self.drains += stream is None


def test_a_failure_waits_for_queued_hardware_work_before_it_is_reported_and_close_drains():
    """Kernels already queued must not keep writing into buffers freed after a failure: synchronize() drains
    the hardware before raising, and close() drains it after stopping the workers."""
    dev = _Counting()

    def boom():
        raise RuntimeError("kernel launch failed")

    dev.submit("compute", boom, "instruction 7 forward(blocks.0)")
    with pytest.raises(DeviceError, match="instruction 7 forward"):
        dev.synchronize()
    assert dev.drains == 1
    dev.close()
    assert dev.drains == 2


def _validation_trainer(n_batches):
    from megatrain.models import preset
    from megatrain.planner import TrainSpec
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    spec = TrainSpec(micro_batch=2, seq_len=32, grad_accum=1, dtype="fp32", total_steps=2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
               for _ in range(n_batches)]
    return Trainer(RunConfig(model=preset("tiny"), train=spec, gpu_mem=64 * 2**20, device="sim")), batches


def test_validation_runs_on_the_compute_stream(monkeypatch):
    """evaluate() submits its work to the compute stream (on CUDA: its stream and its pool), not the caller's."""
    from megatrain.runtime import engine as engine_mod
    from megatrain.runtime import evaluation

    seen = []
    real = engine_mod.Engine._run

    def run(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(engine_mod.Engine, "_run", run)
    tr, batches = _validation_trainer(2)
    with tr:
        assert 3 < evaluation.evaluate(tr.engine, batches) < 8
    assert seen and set(seen) == {"megatrain-sim-compute"}


@pytest.mark.parametrize("n_batches", [1, 5])
def test_validation_reads_the_device_once_whatever_the_batches(monkeypatch, n_batches):
    """The validation loss is summed on the device and read once (on CUDA a read is a sync of the compute
    stream): no float() or item() per batch. Counted on the compute stream, where evaluate's work runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatrain.runtime import evaluation

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    tr, batches = _validation_trainer(n_batches)
    submit = tr.engine.device.submit

    def counted(stream, fn, label):
        def run():
            with Reads():
                fn()
        submit(stream, run if stream == "compute" else fn, label)

    with tr:
        monkeypatch.setattr(tr.engine.device, "submit", counted)
        loss = evaluation.evaluate(tr.engine, batches)
    assert len(reads) == 1 and 3 < loss < 8, (reads, loss)
