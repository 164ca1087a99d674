"""Attention replay (megatrain/models/replay.py): a recompute that takes the fused attention's outputs from its forward
computes the same gradients, bit for bit, and runs no attention; what it records is what the trace says
(UnitIR.replay, peak_bwd_replay_bytes); a recompute that does not match its record is refused."""

import pytest
import torch

from megatrain.ir.scaled import FlopCount, LiveBytes
from megatrain.ir.trace import trace
from megatrain.models import StepInputs, init_weights, preset, rope_tables, routing, run_unit, templates
from megatrain.models.config import ModelConfig
from megatrain.models.replay import Record, _with_lse, record_attention, replay_attention
from megatrain.models.units import template_key

TINY = preset("tiny")
B, T = 2, 24


def _block(config: ModelConfig, layer: int, dtype: torch.dtype, chunk: int | None = None, seq: int = T):
    tmpl = templates(config)[template_key(config, f"blocks.{layer}")]
    weights = init_weights(config, seed=1)
    params = {n: weights[f"blocks.{layer}.{n}"].to(dtype) for n, _ in tmpl.named_parameters()}
    buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in tmpl.named_buffers()} or None
    cos, sin = rope_tables(config, seq, dtype)
    inputs = StepInputs(cos=cos, sin=sin, chunk_tokens=chunk, target="cpu")
    ir = trace(config, B, seq, "float32" if dtype == torch.float32 else "bfloat16", target="cpu", chunk_tokens=chunk)
    unit = ir.unit(f"blocks.{layer}")
    g = torch.Generator().manual_seed(2)
    carry = tuple(torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in unit.carry_in)
    return tmpl, params, buffers, inputs, carry, unit


def _recorded(tmpl, params, buffers, inputs, carry) -> Record:
    rec = Record()
    with routing.step_context(routing.RoutingLog(), 1.0), torch.no_grad(), record_attention(rec):
        run_unit(tmpl, params, carry, inputs, buffers)
    return rec


def _grads(tmpl, params, buffers, inputs, carry, mode=None):
    p = {n: v.detach().clone().requires_grad_() for n, v in params.items()}
    c = tuple(t.detach().clone().requires_grad_() for t in carry)
    flops = FlopCount()
    with routing.step_context(routing.RoutingLog(), 1.0), flops:
        if mode is None:
            out = run_unit(tmpl, p, c, inputs, buffers, recompute=True)
        else:
            with mode:  # inside the counter: what it returns is never counted
                out = run_unit(tmpl, p, c, inputs, buffers, recompute=True)
    g = torch.Generator().manual_seed(3)
    grad_out = [torch.randn(o.shape, generator=g).to(o.dtype) for o in out]
    return torch.autograd.grad(out, [*p.values(), *c], grad_out, allow_unused=True), flops.counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant, chunk", [
    ({}, None), ({}, 8), ({"qkv_bias": True, "qk_norm": True, "n_kv_heads": 1}, 8),
    ({"depth_mixing": "depthssd:4"}, None), ({"depth_mixing": "hc:2"}, 8), ({"depth_mixing": "attnres:2"}, None),
    ({"moe": {"n_experts": 4, "top_k": 1}}, None),
])
def test_replayed_recompute_gives_the_same_gradient_bits(dtype, variant, chunk):
    """The record travels as a host round trip leaves it (contiguous copies); the replayed recompute's
    gradients equal the full recompute's bit for bit, and it counts no attention FLOPs."""
    config = ModelConfig(**{**TINY.model_dump(), **variant})
    if config.moe is not None and chunk is not None:
        pytest.skip("an MoE feed-forward is not tiled")
    tmpl, params, buffers, inputs, carry, unit = _block(config, 1, dtype, chunk)
    rec = _recorded(tmpl, params, buffers, inputs, carry)
    assert [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in rec.tensors] == \
        [(s.shape, s.dtype) for s in unit.replay]
    assert sum(t.nbytes for t in rec.tensors) == unit.replay_bytes > 0
    moved = [t.contiguous().clone() for t in rec.tensors]
    full, full_flops = _grads(tmpl, params, buffers, inputs, carry)
    replayed, flops = _grads(tmpl, params, buffers, inputs, carry, replay_attention(rec, moved))
    assert len(full) == len(replayed)
    for a, b in zip(full, replayed):
        assert (a is None and b is None) or torch.equal(a, b)
    assert full_flops["attention"] > 0 and flops["attention"] == 0
    assert flops["linear"] == full_flops["linear"]
    assert sum(full_flops.values()) - sum(flops.values()) == unit.attn_flops_fwd


def test_replayed_backward_allocates_what_the_trace_says():
    """peak_bwd_replay_bytes is what a real CPU recompute-and-backward under replay allocates (the record and
    the program's buffers excluded), and it is below the full recompute's peak by at least the record."""
    tmpl, params, buffers, inputs, carry, unit = _block(TINY, 1, torch.float32, chunk=8, seq=48)
    rec = _recorded(tmpl, params, buffers, inputs, carry)
    p = {n: v.detach().clone().requires_grad_() for n, v in params.items()}
    c = tuple(t.detach().clone().requires_grad_() for t in carry)
    existing = [*p.values(), *c, inputs.cos, inputs.sin, *rec.tensors]
    with LiveBytes(None, existing) as mem, routing.step_context(None, 1.0):
        with replay_attention(rec):
            out = run_unit(tmpl, p, c, inputs, buffers, recompute=True)
        grads_out = [torch.ones_like(o) for o in out]
        grads = torch.autograd.grad(out, [*p.values(), *c], grads_out)
        mem.exclude([*grads_out, *grads[len(p):]])
        peak = max(sum(n for _, n in s) for s in mem.sums)
    assert peak == unit.peak_bwd_replay_bytes
    assert unit.peak_bwd_replay_bytes <= unit.peak_bwd_bytes - unit.replay_bytes


def test_scaled_trace_prices_replay_exactly():
    """A long sequence traced short and scaled (megatrain/ir/scaled.py) gives the same record shapes and replayed
    backward peak as tracing it at its length."""
    config = ModelConfig(**{**TINY.model_dump(), "max_seq_len": 16384})
    direct = trace(config, 1, 9216, "bfloat16", scaled=False, chunk_options=False, chunk_tokens=1024)
    scaled = trace(config, 1, 9216, "bfloat16", scaled=True, chunk_options=False, chunk_tokens=1024)
    for a, b in zip(direct.units, scaled.units):
        assert a.replay == b.replay
        assert a.peak_bwd_replay_bytes == b.peak_bwd_replay_bytes
    assert direct.units[1].replay[0].shape == (1, TINY.n_heads, 9216, TINY.head_dim)


def test_units_that_cannot_replay_record_nothing():
    ir = trace(TINY, B, T, "float32", target="cpu")
    assert not ir.unit("embed").replay and not ir.unit("head").replay
    assert ir.unit("head").peak_bwd_replay_bytes is None
    packed = trace(TINY, B, T, "float32", target="cpu", packed=True)
    assert all(not u.replay and u.peak_bwd_replay_bytes is None for u in packed.units)


def test_a_recompute_that_differs_from_its_record_is_refused():
    tmpl, params, buffers, inputs, carry, _ = _block(TINY, 1, torch.float32)
    rec = _recorded(tmpl, params, buffers, inputs, carry)
    other = _block(TINY, 1, torch.float32, seq=16)
    with pytest.raises(RuntimeError, match="attention replay: the recompute's fused attention call 0"):
        _grads(*other[:5], replay_attention(rec))
    twice = Record(ops=rec.ops * 2, shapes=rec.shapes * 2, tensors=rec.tensors * 2, rest=rec.rest * 2)
    with pytest.raises(RuntimeError, match="recorded 2 fused attention call"):
        _grads(tmpl, params, buffers, inputs, carry, replay_attention(twice))


def test_kernels_that_skip_the_log_sum_exp_are_asked_for_it():
    """CUDA's memory-efficient and cuDNN kernels compute the log-sum-exp only when asked (a no-grad forward
    does not ask): the recording mode asks, whether the flag is passed by position or by name."""
    aten = torch.ops.aten
    eff = aten._scaled_dot_product_efficient_attention.default
    args, kwargs = _with_lse(eff, ("q", "k", "v", None, False), {})
    assert args[4] is True and not kwargs
    args, kwargs = _with_lse(eff, ("q", "k", "v", None), {"compute_log_sumexp": False})
    assert kwargs["compute_log_sumexp"] is True
    args, kwargs = _with_lse(eff, ("q", "k", "v", None), {})
    assert kwargs == {"compute_log_sumexp": True}
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert _with_lse(flash, ("q", "k", "v", 0.0, True), {}) == (("q", "k", "v", 0.0, True), {})


def test_only_the_attention_call_passes_through_the_modes(monkeypatch):
    """The record and replay modes are entered around the attention call alone (attention_scope): the block's
    other ops never pass through Python dispatch. Around the whole block each of them did, which cost `small`'s
    CPU step 8% (docs/RESULTS.md). Counted per op the modes see, recording and replaying."""
    from megatrain.models import replay

    seen = {"record": [], "replay": []}
    rec_dispatch, rep_dispatch = replay._Recording.__torch_dispatch__, replay._Replaying.__torch_dispatch__

    def counting(kind, dispatch):
        def wrapped(self, func, types, args=(), kwargs=None):
            seen[kind].append(func)
            return dispatch(self, func, types, args, kwargs)
        return wrapped

    monkeypatch.setattr(replay._Recording, "__torch_dispatch__", counting("record", rec_dispatch))
    monkeypatch.setattr(replay._Replaying, "__torch_dispatch__", counting("replay", rep_dispatch))
    tmpl, params, buffers, inputs, carry, _ = _block(TINY, 1, torch.float32)
    rec = _recorded(tmpl, params, buffers, inputs, carry)
    _grads(tmpl, params, buffers, inputs, carry, replay_attention(rec))
    assert len(rec.ops) == 1
    for kind, ops in seen.items():
        assert rec.ops[0] in ops, kind
        assert len(ops) <= 4, f"{kind}: {len(ops)} ops passed through the mode"
    outside = Record()
    with torch.no_grad(), record_attention(outside):  # the mode is current, the call is not in a block
        torch.nn.functional.scaled_dot_product_attention(*(torch.randn(1, 2, 8, 4) for _ in range(3)), is_causal=True)
    assert outside.ops == []
