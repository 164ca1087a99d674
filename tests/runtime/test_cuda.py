"""The exactness and ordering tests on a real GPU (run with `make test-cuda`; skipped without CUDA).

On CUDA the kernels differ from eager's only where the library picks them differently and where atomics
reorder sums (embedding backward), so equality is to fp32 round-off (rtol 1e-5), not bit for bit.
"""

import pytest
import torch
from runtime_schedules import make_batches, plans_by_shape, streamed_train

from megatrain import fake_cuda
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec
from megatrain.runtime.optim import param_groups
from megatrain.runtime.reference import EagerTrainer

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

TINY = preset("tiny")


def _eager_cuda(train, batches, config=TINY):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    trainer = EagerTrainer(config, train)
    trainer.model.cuda()
    trainer.opt = torch.optim.AdamW(param_groups(list(trainer.model.named_parameters()), train), lr=train.lr,
                                    betas=train.betas, eps=train.eps, fused=True)
    losses = [trainer.step([(x.cuda(), y.cuda()) for x, y in b]) for b in batches]
    return {n: p.detach().cpu() for n, p in trainer.model.named_parameters()}, losses


@pytest.mark.parametrize("grad_accum, clip", [(1, None), (3, 1.0)])
def test_streamed_equals_eager_on_cuda(grad_accum, clip):
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=grad_accum, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, clip_norm=clip)
    batches = make_batches(TINY, train, steps=3)
    want, eager_losses = _eager_cuda(train, batches)
    plans = plans_by_shape(TINY, train, target="cuda")
    assert {n for n, _ in plans} >= {1, 2}
    for p in plans.values():
        store, losses, peak = streamed_train(p, batches, kind="cuda")
        assert losses == pytest.approx(eager_losses, rel=1e-5)
        assert peak == p.peak_buffer_bytes
        got = store.named_master()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("mixing", ["denseformer", "hc-dynamic:2", "attnres:3", "depthssd:4"])
def test_depth_mixing_streams_on_cuda(mixing):
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 3, "depth_mixing": mixing})
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, clip_norm=1.0)
    batches = make_batches(config, train, steps=3)
    want, eager_losses = _eager_cuda(train, batches, config)
    for p in plans_by_shape(config, train, budgets_mib=(4, 8, 64), target="cuda").values():
        store, losses, peak = streamed_train(p, batches, kind="cuda")
        assert losses == pytest.approx(eager_losses, rel=1e-5)
        assert peak == p.peak_buffer_bytes
        for name, t in want.items():
            torch.testing.assert_close(store.named_master()[name], t, rtol=1e-5, atol=2e-6, msg=name)


def test_repeated_cuda_runs_agree():
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=1e-3, total_steps=2, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=2)
    for p in plans_by_shape(TINY, train, budgets_mib=(4, 8, 64), target="cuda").values():
        first, losses, _ = streamed_train(p, batches, kind="cuda")
        for _ in range(1 if fake_cuda.installed() else 4):  # the fake's CPU kernels are deterministic
            again, again_losses, _ = streamed_train(p, batches, kind="cuda")
            assert again_losses == pytest.approx(losses, rel=1e-6)
            for name, t in first.named_master().items():
                torch.testing.assert_close(again.named_master()[name], t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention, K and V repeated for the varlen call
def test_packed_attention_uses_one_varlen_call_and_equals_each_document_alone(kv_heads):
    """bf16 on CUDA: every document of a packed micro-batch in one varlen flash call, equal to the per-document
    causal calls (the CPU path) to bf16 round-off, values and gradients."""
    from megatrain.models import StepInputs, packing
    from megatrain.models.layers import packed_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, 96, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for heads in (4, kv_heads, kv_heads))
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in ([40, 56], [7, 9, 80])])
    packed = packing(positions, "cuda")
    fused = packed_attention(q, k, v, StepInputs(**packed))
    looped = packed_attention(q, k, v, StepInputs(positions=packed["positions"], segments=packed["segments"]))
    torch.testing.assert_close(fused, looped, rtol=2e-2, atol=2e-2)
    grads = [torch.autograd.grad(y.float().square().sum(), (q, k, v)) for y in (fused, looped)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


# -- host memory and host policies (issue 14) -------------------------------------------------------------------
# CPU twins: tests/runtime/test_host_policy.py (the same paths on the sim device).
def test_host_arena_page_locks_exact_sizes():
    """The store's pinned buffers are views of one region registered with cudaHostRegister: pinned, at the
    plan's exact size, none of it from torch's power-of-two caching host allocator."""
    from megatrain.planner.host_policy import pinned_region_bytes
    from megatrain.runtime.host_memory import HostArena, HostBuffer

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    arena = HostArena("cuda")
    sizes = [(3_000_001,), (17,), (1 << 20,)]
    out = arena.allocate([HostBuffer(f"b{i}", "x", s, torch.float32, pinned=True) for i, s in enumerate(sizes)])
    assert all(t.is_pinned() for t in out.values())
    assert arena.allocated_bytes == pinned_region_bytes(4 * s[0] for s in sizes)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    dev = torch.empty(sizes[0], device="cuda").fill_(2.0)
    out["b0"].copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert bool((out["b0"] == 2.0).all())
    arena.close()
    assert bool((out["b0"] == 2.0).all())  # unregistered, still valid memory


@pytest.mark.parametrize("policy", ["exact", "bf16", "fp8"])
def test_host_bytes_equal_the_plan_on_cuda(policy):
    from megatrain.runtime.device import CudaDevice
    from megatrain.runtime.engine import Engine
    from megatrain.runtime.store import HostStore

    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="bf16", lr=2e-3, total_steps=3, clip_norm=1.0)
    p = next(iter(plans_by_shape(TINY, train, budgets_mib=(6,), target="cuda", host_policy=policy).values()))
    with CudaDevice(p.gpu_budget_bytes) as dev:
        store = HostStore(p.ir, train, policy=policy, program=p.program, device="cuda")
        Engine(p.ir, p.program, dev, store)
        assert store.host_bytes() == p.host_bytes
        assert all(t.is_pinned() for t in (*store.grad_buffers, *store.stage))
        store.close()


@pytest.mark.parametrize("policy", ["bf16-moments", "bf16", "fp8"])
def test_policies_stream_on_cuda_like_on_the_sim_device(policy):
    """Under a policy the CUDA run rounds the same state the same way; the device's kernels differ from the
    CPU's by fp32 round-off, which a rounding step (bf16: 2^-8, fp8: 2^-3 relative) may turn into one quantum
    of a moment, so weights agree to a fraction of one update (lr 2e-3), not to rtol 1e-5."""
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=3)
    sim = next(iter(plans_by_shape(TINY, train, budgets_mib=(8,), host_policy=policy).values()))
    gpu = next(iter(plans_by_shape(TINY, train, budgets_mib=(8,), target="cuda", host_policy=policy).values()))
    want, want_losses, _ = streamed_train(sim, batches)
    got, losses, peak = streamed_train(gpu, batches, kind="cuda")
    assert losses == pytest.approx(want_losses, rel=1e-4)
    assert peak == gpu.peak_buffer_bytes
    for name, t in want.named_master().items():
        torch.testing.assert_close(got.named_master()[name], t, rtol=0, atol=2e-4, msg=name)


def test_staged_bf16_loads_and_converting_stores_on_cuda(monkeypatch):
    """bf16 loads cast the master through the pinned staging ring (two small buffers: several chunks, each
    waiting for the copy two chunks back), and a bf16 gradient store converts on the GPU in chunks."""
    import megatrain.planner.host_policy as hp
    import megatrain.runtime.device as device_module
    from megatrain.ir.trace import trace
    from megatrain.planner import hardware_preset, plan
    from megatrain.runtime.device import CudaDevice
    from megatrain.runtime.store import HostStore

    monkeypatch.setattr(hp, "STAGE_ELEMS", 5000)
    monkeypatch.setattr(device_module, "CONVERT_CHUNK", 4096)
    train = TrainSpec(micro_batch=2, seq_len=64, dtype="bf16", total_steps=3)
    ir = trace(TINY, 2, 64, "bf16", target="cuda")
    p = plan(ir, hardware_preset("h100-sxm"), train, host_policy="bf16")
    with CudaDevice() as dev:
        store = HostStore(ir, train, policy="bf16", program=p.program, device="cuda")
        for u in ir.units:
            slot = torch.full((u.flat_numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()  # the fill ran on the default stream, which the h2d stream does not wait on
            dev.submit("h2d", lambda u=u, slot=slot: store.load_params(u.name, slot, dev), "load")
            dev.synchronize()
            assert torch.equal(slot.cpu(), store.units[u.name].master.to(torch.bfloat16)), u.name
        src = torch.randn(50_001, device="cuda")
        torch.cuda.synchronize()  # made on the default stream, which the d2h stream does not wait on
        dst = torch.empty(50_001, dtype=torch.bfloat16, pin_memory=True)
        dev.submit("d2h", lambda: dev.copy(dst, src), "store")
        dev.synchronize()
        assert torch.equal(dst, src.to(torch.bfloat16).cpu())
        store.close()


# -- GPU readiness (issue 16); CPU twins: tests/runtime/test_gpu_readiness.py -------------------------------------
def test_the_allocator_cap_holds_the_process_to_the_budget_and_close_lifts_it():
    from megatrain.runtime.device import CudaDevice

    torch.cuda.empty_cache()
    cap = torch.cuda.memory_reserved() + 256 * 2**20
    with CudaDevice(2**30) as dev:
        dev.limit_allocator(cap)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        report = dev.memory_report()
        assert report["peak_device_bytes"] >= x.numel() and report["peak_reserved_bytes"] >= x.numel()
        assert report["device_total_bytes"] >= report["device_used_bytes"] >= report["peak_reserved_bytes"]
        del x
    torch.cuda.empty_cache()
    y = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # the cap went with the device
    del y


def test_cuda_stream_workers_run_with_the_cpu_budget():
    from megatrain.runtime.device import CudaDevice
    from megatrain.runtime.stream_device import STREAMS

    seen = {}
    with CudaDevice() as dev:
        for s in STREAMS:
            dev.submit(s, lambda s=s: seen.__setitem__(s, torch.get_num_threads()), "threads")
        dev.synchronize()
        assert seen == dev.cpu.threads and seen["compute"] == 1
        assert set(dev.cpu.cores) <= set(range(__import__("os").cpu_count()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_equals_eager_under_random_gpu_side_delays(seed):
    """torch.cuda._sleep before each GPU stream op (CudaDevice gpu_delays) runs the streams out of step on
    the GPU itself, where a missing wait shows as a wrong value; deterministic algorithms make the undelayed
    run the exact baseline. The fake CUDA backend runs work when issued (it checks the waits instead), so
    one seed covers its path."""
    if seed and fake_cuda.installed():
        pytest.skip("the fake CUDA backend reorders nothing on a GPU-side delay: seed 0 covers the path")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                          total_steps=2, clip_norm=1.0)
        batches = make_batches(TINY, train, steps=2)
        want, eager_losses = _eager_cuda(train, batches)
        for p in plans_by_shape(TINY, train, budgets_mib=(4, 64), target="cuda").values():
            base, base_losses, _ = streamed_train(p, batches, kind="cuda")
            store, losses, _ = streamed_train(p, batches, kind="cuda", delays=(0, 200_000), seed=seed)
            assert losses == base_losses and losses == pytest.approx(eager_losses, rel=1e-5)
            for name, t in base.named_master().items():
                assert torch.equal(store.named_master()[name], t), name
                torch.testing.assert_close(t, want[name], rtol=1e-5, atol=1e-6, msg=name)
    finally:
        torch.use_deterministic_algorithms(False)


def test_bf16_at_seq_512_uses_the_flash_kernel_and_tracks_the_sim_run():
    """Every attention call of a bf16 run at seq 512 goes through flash (SDPA restricted to it raises
    otherwise), its first loss (the same bf16 weights, no update yet) equals eager bf16 on the GPU through the
    same kernel to bf16 round-off, and the run follows the same plan on the sim device (CPU bf16 kernels)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    train = TrainSpec(micro_batch=1, seq_len=512, grad_accum=2, dtype="bf16", lr=2e-3, warmup_steps=1,
                      total_steps=2, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=2)
    sim = next(iter(plans_by_shape(TINY, train, budgets_mib=(64,)).values()))
    gpu = next(iter(plans_by_shape(TINY, train, budgets_mib=(64,), target="cuda").values()))
    _, want_losses, _ = streamed_train(sim, batches)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _, losses, peak = streamed_train(gpu, batches, kind="cuda")
        eager = EagerTrainer(TINY, train, dtype=torch.bfloat16)
        eager.model.cuda()
        first = eager.step([tuple(t.cuda() for t in mb) for mb in batches[0]])
    assert losses[0] == pytest.approx(first, rel=2e-3)
    assert losses == pytest.approx(want_losses, rel=2e-2)
    assert peak == gpu.peak_buffer_bytes


def test_moe_streams_on_cuda_like_eager():
    """On the fake CUDA backend the device kernels are the CPU's, run by the compute worker with its one intra-op
    thread (runtime/cpus.py thread_budget): the eager reference computes with as many and the run equals it bit
    for bit. NOTE: with the process's threads it did not (up to 1.3e-5 after a step, token choice only, torch's
    AdamW and the host store's alike): a CPU matmul whose contraction is an expert's rows (a weight gradient)
    splits it by threads, and AdamW's first step turns that round-off of a near-zero gradient into one of the
    update. On a GPU the kernels differ (and a routing decision may flip on round-off): a bound of a fraction of
    one update (lr 2e-3)."""
    from test_moe_exactness import CASES, _train, moe_config

    from megatrain.runtime.cpus import thread_budget

    exact = fake_cuda.installed()
    for name, (moe, grad_accum, clip) in CASES.items():
        config = moe_config(**moe)
        train = _train(grad_accum, clip, steps=2)
        batches = make_batches(config, train, steps=2)
        threads = torch.get_num_threads()
        torch.set_num_threads(thread_budget("cuda", threads)["compute"] if exact else threads)
        try:
            want, eager_losses = _eager_cuda(train, batches, config)
        finally:
            torch.set_num_threads(threads)
        p = next(iter(plans_by_shape(config, train, budgets_mib=(64,), target="cuda").values()))
        store, losses, _ = streamed_train(p, batches, kind="cuda")
        master = store.named_master()
        if exact:
            assert losses == eager_losses, name
            assert all(torch.equal(master[n], t) for n, t in want.items()), name
            continue
        assert losses == pytest.approx(eager_losses, rel=1e-4), name
        for n, t in want.items():
            torch.testing.assert_close(master[n], t, rtol=1e-4, atol=5e-5, msg=f"{name} {n}")


def test_trainer_checkpoint_and_resume_on_cuda(tmp_path):
    from runtime_schedules import make_token_files

    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        train_file, _ = make_token_files(tmp_path)
        train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="bf16", lr=2e-3, warmup_steps=1,
                          total_steps=4, clip_norm=1.0)
        run = dict(data=train_file, device="cuda", checkpoint_every=2)
        with Trainer(RunConfig(model=TINY, train=train, gpu_mem=2 * 2**30, checkpoint_dir=tmp_path / "a", **run)) as t:
            whole = [r["loss"] for r in t.run(4, progress=False, handle_signals=False)]
            assert t.device.kind == "cuda" and t.plan.hardware.name != "cpu"
        with Trainer(RunConfig(model=TINY, train=train, gpu_mem=2 * 2**30, checkpoint_dir=tmp_path / "b",
                               resume=tmp_path / "a/step-00000002", **run)) as t:
            resumed = [r["loss"] for r in t.run(2, progress=False, handle_signals=False)]
        assert resumed == pytest.approx(whole[2:], rel=1e-6)
    finally:
        torch.use_deterministic_algorithms(False)


def test_copies_overlap_compute_on_a_truncated_7b():
    """Two blocks of llama2-7b in bf16 under a budget that streams them: some h2d copy runs while compute
    does (CUDA event times), which is the point of the streams. On the fake CUDA backend (CPU memory holds
    the device's tensors too) the blocks are a quarter as wide, and the budget scales with them."""
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    narrow = {"d_model": 1024, "ffn_dim": 2752, "vocab_size": 8000} if fake_cuda.installed() else {}
    config = ModelConfig(**{**preset("llama2-7b").model_dump(), "n_layers": 2, "name": "llama2-7b-2L", **narrow})
    train = TrainSpec(micro_batch=1, seq_len=512, grad_accum=2, dtype="bf16", lr=1e-4, total_steps=10)
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, config.vocab_size, (1, 512), generator=g),) * 2 for _ in range(2)]
    budget = 2**30 + 5 * 2**30 // 16 if narrow else 6 * 2**30  # the profile reserves 1 GiB either way
    with Trainer(RunConfig(model=config, train=train, gpu_mem=budget, device="cuda")) as t:
        assert t.plan.n_slots < len(t.plan.ir.units)  # it streams
        t.train_step(batch)
        t.engine.start_timeline()
        t.train_step(batch)
        spans = t.engine.measured_spans()
    compute = [(a, b) for s, _, _, a, b, _ in spans if s == "compute"]
    h2d = [(a, b) for s, _, _, a, b, _ in spans if s == "h2d"]
    assert compute and h2d
    assert any(a < d and c < b for a, b in h2d for c, d in compute)
