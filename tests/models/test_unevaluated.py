"""A block's recompute leaves its last matmul unevaluated (megatrain/models/unevaluated.py): the gradients are the same
bits as a full forward's, the FLOPs drop by exactly the down projection's, and the trace prices and counts
what runs; blocks whose sub-layer outputs are read (depth mixing, MoE) recompute in full. Unevaluated
products hold NaN in tests (tests/conftest.py), so a gradient that read one would show it."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatrain.ir.scaled import FlopCount, LiveBytes
from megatrain.ir.trace import trace
from megatrain.models import StepInputs, init_weights, preset, rope_tables, routing, run_unit, templates
from megatrain.models.config import ModelConfig
from megatrain.models.unevaluated import unevaluated
from megatrain.planner import hardware_preset
from megatrain.planner.costs import CostModel

TINY = preset("tiny")
B, T = 2, 24


def _block(config: ModelConfig, layer: int, dtype: torch.dtype, chunk: int | None = None):
    tmpl = templates(config)[_key(config, layer)]
    weights = init_weights(config, seed=1)
    params = {n: weights[f"blocks.{layer}.{n}"].to(dtype) for n, _ in tmpl.named_parameters()}
    buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in tmpl.named_buffers()}
    cos, sin = rope_tables(config, T, dtype)
    inputs = StepInputs(cos=cos, sin=sin, chunk_tokens=chunk, target="cpu")
    g = torch.Generator().manual_seed(2)
    carry_shapes = _carry_shapes(config, layer)
    carry = tuple(torch.randn(s, generator=g).to(dtype) for s in carry_shapes)
    return tmpl, params, buffers, inputs, carry


def _key(config, layer):
    from megatrain.models.units import template_key

    return template_key(config, f"blocks.{layer}")


def _carry_shapes(config, layer):
    ir = trace(config, B, T, "float32", target="cpu")
    return [s.shape for s in ir.unit(f"blocks.{layer}").carry_in]


def _grads(tmpl, params, buffers, inputs, carry, recompute: bool):
    p = {n: v.detach().clone().requires_grad_() for n, v in params.items()}
    c = tuple(t.detach().clone().requires_grad_() for t in carry)
    g = torch.Generator().manual_seed(3)
    fwd, bwd = FlopCount(), FlopCount()  # NOTE: FlopCounterMode's module hooks fail in a tile's nested grad
    with routing.step_context(routing.RoutingLog(), 1.0), fwd:
        out = run_unit(tmpl, p, c, inputs, buffers or None, **({"recompute": True} if recompute else {}))
    grad_out = [torch.randn(o.shape, generator=g).to(o.dtype) for o in out]
    with bwd:
        grads = torch.autograd.grad(out, [*p.values(), *c], grad_out, allow_unused=True)
    return grads, sum(fwd.counts.values()), sum(bwd.counts.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "qk_norm": True, "n_kv_heads": 1}])
def test_dense_block_recompute_same_gradient_bits_fewer_flops(dtype, variant):
    config = ModelConfig(**{**TINY.model_dump(), **variant})
    args = _block(config, 1, dtype)
    full, full_flops, _ = _grads(*args, recompute=False)
    lean, lean_flops, _ = _grads(*args, recompute=True)
    assert len(full) == len(lean) and all(g is not None for g in full)
    for a, b in zip(full, lean):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert full_flops - lean_flops == 2 * B * T * config.d_model * config.ffn_dim


@pytest.mark.parametrize("case", [
    {"depth_mixing": "denseformer"}, {"depth_mixing": "depthssd:4"}, {"depth_mixing": "hc:2"}, {"base": "moe-tiny"},
])
def test_blocks_that_read_their_outputs_recompute_in_full(case):
    case = dict(case)
    base = preset(case.pop("base", "tiny"))
    config = ModelConfig(**{**base.model_dump(), **case, "n_layers": 3})
    args = _block(config, 1, torch.float32)
    full, full_flops, _ = _grads(*args, recompute=False)
    lean, lean_flops, _ = _grads(*args, recompute=True)
    assert lean_flops == full_flops > 0
    for a, b in zip(full, lean):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "qk_norm": True, "n_kv_heads": 1},
                                     {"depth_mixing": "denseformer"}])
def test_tiled_block_recomputes_only_what_its_backward_reads(dtype, variant):
    """Tiled (chunks of 8 of 24 tokens): a tile's recompute in backward skips its projections (q and k only
    without qk-norm) and the MLP's down projection; a residual block's recompute computes no MLP tile at all.
    Gradients: the same bits as without either."""
    config = ModelConfig(**{**TINY.model_dump(), **variant, "n_layers": 3})
    d, ff, hd = config.d_model, config.ffn_dim, config.head_dim
    tiled = _block(config, 1, dtype, chunk=8)
    full, fwd, bwd = _grads(*tiled, recompute=False)
    lean, fwd_lean, bwd_lean = _grads(*tiled, recompute=True)
    for a, b in zip(full, lean):
        assert a.dtype == b.dtype and torch.equal(a, b)
    _, _, bwd_untiled = _grads(*_block(config, 1, dtype), recompute=False)
    mlp = 3 * 2 * B * T * d * ff
    residual = "depth_mixing" not in variant
    assert fwd - fwd_lean == (mlp if residual else 0)
    # the backward's own FLOPs (as untiled) plus the tiles' recompute of the gate and up projections, and of
    # q and k where qk-norm reads them
    qk = 2 * B * T * d * (config.n_heads + config.kv_heads) * hd if config.qk_norm else 0
    assert bwd == bwd_lean == bwd_untiled + 2 * 2 * B * T * d * ff + qk


def test_unevaluated_product_is_recorded_and_allocated_but_not_computed():
    a = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    with LiveBytes() as mem, FlopCounterMode(display=False) as flops:
        with unevaluated():
            y = torch.nn.functional.linear(a, w)
    assert y.shape == (5, 3) and y.grad_fn is not None and bool(y.isnan().all())
    assert flops.get_total_flops() == 0
    assert max(sum(n for _, n in s) for s in mem.sums) >= y.untyped_storage().nbytes()  # the output was seen
    g = torch.randn(5, 3)
    ga, gw = torch.autograd.grad(y, [a, w], g)
    ref = torch.nn.functional.linear(a, w)
    ra, rw = torch.autograd.grad(ref, [a, w], g)
    assert torch.equal(ga, ra) and torch.equal(gw, rw)
    # outside the mode products are computed again
    assert torch.equal(torch.nn.functional.linear(a, w), ref)


def test_trace_prices_the_recompute_it_runs():
    ir = trace(TINY, B, T, "float32", target="cpu")
    tail = 2 * B * T * TINY.d_model * TINY.ffn_dim
    for u in ir.units:
        expected = u.flops_fwd - tail if u.kind == "block" else u.flops_fwd
        assert u.recompute_flops == expected, u.name
    costs = CostModel(ir, hardware_preset("cpu"), clip=False)
    blocks = [i for i, u in enumerate(ir.units) if u.kind == "block"]
    assert all(costs.recompute[i] < costs.fwd[i] for i in blocks)
    assert costs.backward(blocks[0], keep=False) - costs.backward(blocks[0], keep=True) == costs.recompute[blocks[0]]
    tiled = trace(TINY, B, T, "float32", target="cpu", chunk_tokens=8)
    mlp = 3 * 2 * B * T * TINY.d_model * TINY.ffn_dim
    for u in tiled.units:
        assert u.recompute_flops == (u.flops_fwd - mlp if u.kind == "block" else u.flops_fwd), u.name
