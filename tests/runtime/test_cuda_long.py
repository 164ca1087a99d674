"""Long context on a real GPU (run with `make test-cuda`; skipped without CUDA), and on the fake CUDA backend
in CI (`make test-cuda-fake`). Not yet run on a GPU: no GPU was lent to the tasks that wrote them.

Tiled units stream as eager tiled ones do, to fp32 round-off (CUDA kernels may sum differently); grouped-query
attention with unrepeated k and v runs the flash kernel (no T x T scores: the measured peak of a tiled
block's backward is far below one head's scores and within 10% of the traced workspace); staged checkpoint
copies round-trip exactly through the pinned buffers on the copy streams.
"""

import pytest
import torch
from runtime_schedules import make_batches, plans_by_shape, streamed_train

from megatrain import fake_cuda
from megatrain.ir.trace import _unit_inputs, trace
from megatrain.models import ModelConfig, preset, run_unit, templates
from megatrain.planner import TrainSpec
from megatrain.runtime.device import CudaDevice
from megatrain.runtime.optim import param_groups
from megatrain.runtime.reference import EagerTrainer
from megatrain.runtime.staging import Staging

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

TINY = preset("tiny")


def test_streamed_tiled_equals_eager_tiled_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=2e-3, total_steps=2, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=2)
    trainer = EagerTrainer(TINY, train, chunk_tokens=24)
    trainer.model.cuda()
    trainer.opt = torch.optim.AdamW(param_groups(list(trainer.model.named_parameters()), train), lr=train.lr,
                                    betas=train.betas, eps=train.eps, fused=True)
    eager_losses = [trainer.step([(x.cuda(), y.cuda()) for x, y in b]) for b in batches]
    for p in plans_by_shape(TINY, train, budgets_mib=(3, 64), target="cuda", chunk_tokens=24).values():
        assert p.ir.chunk_tokens == 24
        store, losses, peak = streamed_train(p, batches, kind="cuda")
        assert losses == pytest.approx(eager_losses, rel=1e-5) and peak == p.peak_buffer_bytes
        got = store.named_master()
        for name, t in trainer.model.named_parameters():
            torch.testing.assert_close(got[name], t.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)


def test_tiled_block_runs_flash_with_grouped_kv_and_its_traced_workspace():
    """On the fake CUDA backend the block runs through the same path at 2k tokens (CPU kernels: its memory is
    not a GPU kernel's, so the two bounds below are a device run's to check)."""
    fake = fake_cuda.installed()
    seq, chunk = (2048, 512) if fake else (16384, 2048)
    config = ModelConfig(**{**preset("llama3-8b").model_dump(), "d_model": 1024, "n_heads": 8, "n_kv_heads": 2,
                            "ffn_dim": 3584, "n_layers": 1, "vocab_size": 1024, "max_seq_len": seq})
    ir = trace(config, 1, seq, "bf16", target="cuda", chunk_tokens=chunk)
    u = ir.units[1]
    tm = templates(config)[u.template]  # meta: run_unit binds every parameter
    dev = torch.device("cuda")
    inputs = _unit_inputs("block", config, 1, seq, torch.bfloat16, 1024, "cuda", chunk=chunk)
    inputs = type(inputs)(cos=inputs.cos.to(dev), sin=inputs.sin.to(dev), chunk_tokens=chunk)
    params = {n: (torch.randn(p.shape, device=dev) * 0.02).bfloat16().requires_grad_() for n, p in tm.named_parameters()}
    carry = (torch.randn(1, seq, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True),)
    grad_out = (torch.randn_like(carry[0]),)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run_unit(tm, params, carry, inputs)
    grads = torch.autograd.grad(out, [*params.values(), *carry], grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    assert all(g.is_cuda and bool(g.float().isfinite().all()) for g in grads)
    if fake:
        return
    scores = seq * seq * 2  # one head's (T, T) in bf16: what a math fallback would materialise
    assert peak < scores / 4
    assert peak <= 1.1 * (u.peak_bwd_bytes + 2 * u.carry_in_bytes)  # + the carry's gradient, a program buffer


def test_staged_copies_round_trip_on_the_copy_streams():
    with CudaDevice() as dev:
        st = Staging(dev, chunk=64 * 2**20)
        src = torch.randn(150 * 2**20 // 4, device="cuda")  # 150 MiB: three chunks, the last one short
        torch.cuda.synchronize()  # made on the default stream, which the d2h stream does not wait on
        host, back = torch.empty(src.shape), torch.empty_like(src)
        dev.submit("d2h", lambda: st.to_host(host, src), "to_host")
        dev.record("d2h", "off", 0)
        dev.wait("h2d", "off", 0)
        dev.submit("h2d", lambda: st.to_device(back, host), "to_device")
        dev.synchronize()
        assert torch.equal(back, src) and torch.equal(host, src.cpu())
        assert not host.is_pinned() and st.pinned_bytes() == 4 * 64 * 2**20
