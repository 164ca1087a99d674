"""Sequence tiling (megatrain/models/tiled.py): a tiled unit computes what the untiled one does.

Chunked equals unchunked for the whole eager model's loss and every parameter gradient: in fp64 to 1e-12
(the same math), in fp32 to round-off (the weight-gradient sums over chunks associate differently; the loss,
whose per-chunk rows and summation order are unchanged, is bit-equal on CPU). A chunk of at least the
sequence runs the untiled code, so it equals it bit for bit. Dense, packed, and every depth mixing.
"""

import pytest
import torch
from torch import nn

from megatrain.models import ModelConfig, build_eager, preset
from megatrain.models.routing import RoutingLog
from megatrain.models.tiled import tiled
from megatrain.runtime.reference import _loss_sum


def _loss_and_grads(config, chunk, dtype, seq=64, packed=False):
    model = build_eager(config, seed=0, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, seq), generator=g)
    targets = torch.randint(0, config.vocab_size, (2, seq), generator=g)
    targets[0, :5] = -100
    positions = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)]).repeat(2, 1) if packed else None
    loss = _loss_sum(model, tokens, targets, False, 16, [RoutingLog() for _ in model.blocks], 1.0, positions,
                     chunk_tokens=chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _config(mixing="residual", **changes):
    return ModelConfig(**{**preset("tiny").model_dump(), "n_layers": 3, "depth_mixing": mixing, **changes})


@pytest.mark.parametrize("mixing, packed", [
    ("residual", False), ("residual", True), ("depthssd:4", False),
    *(pytest.param(m, p, marks=pytest.mark.slow) for m, p in [
        ("depthssd:4", True), ("denseformer:2x2", False), ("denseformer:2x2", True), ("hc-dynamic:2", False),
        ("hc-dynamic:2", True), ("attnres:3", False), ("attnres:3", True)])])
def test_chunked_equals_unchunked(mixing, packed):
    config = _config(mixing)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        want_loss, want = _loss_and_grads(config, None, dtype, packed=packed)
        got_loss, got = _loss_and_grads(config, 24, dtype, packed=packed)  # 24 does not divide 64: a short last chunk
        assert torch.equal(got_loss, want_loss)
        for name in want:
            scale = want[name].abs().max().clamp(min=1e-30)
            err = float((got[name] - want[name]).abs().max() / scale)
            # NOTE: relative to the largest element: fp32 sums over 3 chunks round differently; a depth-mixing
            # coefficient's gradient is one sum over all B x T x d products, with cancellation: 10x the room
            assert err < tol * (10 if ".mix." in name and dtype == torch.float32 else 1), (mixing, dtype, name, err)
        tiled_params = [n for n in want if ".mlp." in n or ".self_attn." in n or "layernorm" in n]
        assert len(tiled_params) == 3 * 9 and all(want[n].abs().sum() > 0 for n in tiled_params)


@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "qk_norm": True, "n_kv_heads": 1}])
def test_chunk_of_the_whole_sequence_is_the_untiled_code(variant):
    config = _config(**variant)
    want_loss, want = _loss_and_grads(config, None, torch.float32)
    for chunk in (64, 1000):
        got_loss, got = _loss_and_grads(config, chunk, torch.float32)
        assert torch.equal(got_loss, want_loss)
        assert all(torch.equal(got[n], want[n]) for n in want)
    tiled_loss, tiled_grads = _loss_and_grads(config, 16, torch.float32)
    assert torch.equal(tiled_loss, want_loss)
    assert any(not torch.equal(tiled_grads[n], want[n]) for n in want)  # the tiled path did run


def test_tiled_piece_gradcheck_and_fp32_accumulation():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)

    def piece(a, b):
        return tiled(lambda m, xc, s, e: (torch.tanh(m["lin"](xc)), xc.sum(-1, keepdim=True)), {"lin": lin}, a, 3,
                     out_dims=(1, 1))

    assert torch.autograd.gradcheck(lambda a: piece(a, None), (x,))
    w = lin.weight
    gw = torch.autograd.grad(piece(x, None)[0].sum(), w)[0]
    ew = torch.autograd.grad(torch.tanh(lin(x)).sum(), w)[0]
    torch.testing.assert_close(gw, ew)
    # bf16 parameters: per-chunk gradients are summed in fp32, then rounded once: as close to the exact sum as
    # the untiled bf16 gradient is (one bf16 rounding of the largest element, 2^-8)
    lb = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    xb = torch.randn(1, 256, 64, dtype=torch.bfloat16)
    got = torch.autograd.grad(tiled(lambda m, xc, s, e: (m["l"](xc),), {"l": lb}, xb, 16)[0].sum(), lb.weight)[0]
    want = torch.autograd.grad(lb(xb).sum(), lb.weight)[0]
    exact = xb.float().reshape(-1, 64).sum(0).expand(64, 64)
    assert got.dtype == torch.bfloat16
    for g in (got, want):
        assert float((g.float() - exact).abs().max() / exact.abs().max()) < 2**-8
    with pytest.raises(ValueError, match="positive number of tokens"):
        tiled(lambda m, xc, s, e: (xc,), {}, x, 0)
