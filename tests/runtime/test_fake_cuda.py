"""The fake CUDA backend itself (megatrain/fake_cuda/): what it refuses, what it records, and that the CUDA
path's step keeps to its protocol under it. Runs in `make test-cuda-fake`; skipped on a real GPU."""

import pytest
import torch
from runtime_schedules import make_batches, plans_by_shape, streamed_train

from megatrain import fake_cuda
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not fake_cuda.installed(), reason="checks the fake CUDA backend (make test-cuda-fake)")]

TINY = preset("tiny")


def test_device_tensors_say_cuda_and_refuse_host_operands():
    a = torch.randn(4, 8, device="cuda")
    assert a.is_cuda and a.device == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a * torch.randn(4, 8)
    assert (a * torch.tensor(2.0)).is_cuda  # a 0-dim host scalar is allowed, as on a GPU
    with pytest.raises(TypeError, match="numpy"):
        a.numpy()
    assert torch.equal(a.cpu() * 2, (a * 2).cpu()) and not a.cpu().is_cuda


def test_parameters_and_gradients_stay_on_the_device():
    m = torch.nn.Linear(8, 4).cuda()
    assert all(p.is_cuda and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    m(torch.randn(2, 8, device="cuda")).square().sum().backward()
    assert all(p.grad.is_cuda for p in m.parameters())
    torch.optim.AdamW(m.parameters(), fused=True).step()


def test_a_read_on_another_stream_needs_an_event_wait():
    a = torch.ones(1024, device="cuda")  # written on the default stream
    side = torch.cuda.Stream()
    with pytest.raises(fake_cuda.ProtocolError, match="does not know of"), torch.cuda.stream(side):
        a.sum()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert float(a.sum().cpu()) == 1024.0
    torch.cuda.current_stream().wait_stream(side)  # before `a` is freed: its memory goes back to this stream


def test_calls_that_touch_no_data_are_no_accesses():
    """requires_grad_ and in-place view changes run no kernel: a copy reading the memory on another stream
    meanwhile is no race (a streamed checkpoint pulls a device unit while the forward flags its parameters)."""
    a = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    a[:128].requires_grad_()
    a.unsqueeze_(0).squeeze_(0)
    with torch.cuda.stream(side):
        assert float(a.sum().cpu()) == 1024.0
    a.mul_(2)  # a real write still needs the wait
    with pytest.raises(fake_cuda.ProtocolError, match="does not know of"), torch.cuda.stream(side):
        a.sum()
    torch.cuda.current_stream().wait_stream(side)


def test_host_memory_reused_only_after_the_copy_that_reads_it():
    stage = torch.empty(1024, pin_memory=True)
    assert stage.is_pinned()
    dst = torch.empty(1024, device="cuda")
    h2d = torch.cuda.Stream()
    h2d.wait_stream(torch.cuda.current_stream())
    stage.fill_(1.0)
    with torch.cuda.stream(h2d):
        dst.copy_(stage, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    with pytest.raises(fake_cuda.ProtocolError, match="write of host memory"):
        stage.fill_(2.0)  # the copy may still be reading it
    done.synchronize()
    stage.fill_(2.0)
    torch.cuda.current_stream().wait_stream(h2d)  # before `dst` is freed
    kinds = [k for k, _ in fake_cuda.state().syncs]
    assert "event.synchronize" in kinds


def test_device_memory_freed_under_another_streams_use_is_a_violation():
    state = fake_cuda.state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    x = torch.ones(256, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    del x
    import gc

    gc.collect()
    assert any("freed while stream" in v for v in state.violations)
    state.violations.clear()
    y = torch.ones(256, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y.add_(1)
    y.record_stream(side)  # handed over: the allocator keeps it until side passes this point
    del y
    gc.collect()
    assert not state.violations


def test_the_allocator_cap_raises_out_of_memory():
    torch.cuda.set_per_process_memory_fraction(2**20 / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(2**21, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_eager_reference_builds_its_rope_tables_on_the_device():
    """megatrain/runtime/reference.py's loss made its RoPE tables on the host: on a GPU, apply_rope met CPU tables."""
    from megatrain.runtime.reference import EagerTrainer

    train = TrainSpec(micro_batch=1, seq_len=16, dtype="fp32", total_steps=1)
    trainer = EagerTrainer(TINY, train)
    trainer.model.cuda()
    x = torch.randint(0, TINY.vocab_size, (1, 16), device="cuda")
    assert isinstance(trainer.step([(x, x)]), float)


@pytest.mark.parametrize("config", [TINY, ModelConfig(**{**TINY.model_dump(), "n_layers": 2,
                                                          "moe": {"n_experts": 4, "top_k": 2}})],
                         ids=["dense", "moe"])
def test_a_streamed_step_synchronizes_only_where_its_program_says(config):
    """During steps the host waits on the GPU only in the device's named places (a host stream waiting on a
    GPU record, the staging ring's reuse, synchronize at the step's end), never implicitly (.item(),
    .tolist() or a blocking copy of a device tensor), and its pinned bytes are the plan's."""
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="bf16", lr=2e-3, total_steps=2, clip_norm=1.0)
    batches = make_batches(config, train, steps=2)
    state = fake_cuda.state()
    for p in plans_by_shape(config, train, budgets_mib=(4, 64), target="cuda").values():
        state.syncs.clear()
        before = state.registered_bytes
        store, losses, _ = streamed_train(p, batches, kind="cuda")
        # a routed layer too: its training forward and recompute read nothing back (models/routing.py)
        implicit = [(k, where) for k, where in state.syncs if k.startswith("implicit")]
        assert not implicit, implicit[:5]
        assert {where.split(":")[0] for k, where in state.syncs if not k.startswith("implicit")} \
            <= {"runtime/device.py"}, state.syncs[:5]
        from megatrain.planner.host_policy import PAGE, pinned_region_bytes

        pinned = [b.nbytes for b in store._buffers() if b.pinned]  # page-locked: the region less its slack page
        assert state.registered_bytes - before == pinned_region_bytes(pinned) - PAGE > 0
        store.close()
        assert state.registered_bytes == before


def test_the_host_optimizer_and_the_cast_are_checked_too():
    """megatrain's C kernels touch host memory through pointers; the fake checks them at their entry: AdamW on
    gradients a d2h copy may still be writing, a cast into a staging buffer an h2d copy may still read."""
    from megatrain.runtime import cast_kernel
    from megatrain.runtime import store as store_module

    src = torch.ones(64, device="cuda")
    d2h = torch.cuda.Stream()  # the entry points are wrapped once the runtime makes a stream
    d2h.wait_stream(torch.cuda.current_stream())
    grad = torch.empty(64, pin_memory=True)
    with torch.cuda.stream(d2h):
        grad.copy_(src, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
    with pytest.raises(fake_cuda.ProtocolError, match="adamw_step"):
        store_module.adamw_step("exact", [torch.zeros(64)], [grad], [], [], None, 1e-3)
    with pytest.raises(fake_cuda.ProtocolError, match="cast_kernel.cast"):
        cast_kernel.cast(torch.zeros(64), grad)
    landed.synchronize()
    cast_kernel.cast(torch.zeros(64), grad)
    torch.cuda.current_stream().wait_stream(d2h)


def test_cuda_only_refusals_and_auto_choices():
    """The CUDA path's own errors and `auto` choices, which only a machine that sees a GPU reaches."""
    import importlib.util

    from megatrain.planner.hardware import hardware_for_device
    from megatrain.runtime import compiled
    from megatrain.runtime.device import CudaDevice, allocator_fraction, allocator_settings, make_device

    with pytest.raises(ValueError, match="out of range"):
        CudaDevice(index=torch.cuda.device_count())
    with pytest.raises(ValueError, match="gpu_delays"):
        CudaDevice(gpu_delays=(5, 1))
    with pytest.raises(ValueError, match="must be > 0 bytes"):
        allocator_fraction(0, 2**30)
    with pytest.raises(ValueError, match="lower the GPU budget"):
        allocator_fraction(2**31, 2**30)
    assert allocator_settings({}) == "expandable_segments:True"
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "x"}) is None
    with make_device("auto") as dev:
        assert dev.kind == "cuda"
    assert hardware_for_device("auto").name == "h100-sxm"  # the fake says it is an H100
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(ValueError, match="needs Triton"):
            compiled.check_toolchain("cuda")


def test_megatrain_train_on_auto_picks_the_gpu(tmp_path):
    """`megatrain train --device auto` on a machine that sees a GPU: the CLI's whole CUDA path, one step."""
    import json

    from megatrain.cli import main

    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", "tiny", "--device", "auto", "--gpu-mem", "2GiB", "--seq-len", "32",
                 "--micro-batch", "1", "--steps", "1", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any("loss" in r for r in records)

