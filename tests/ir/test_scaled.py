"""Scaled tracing (megatrain/ir/scaled.py): a template traced at a short sequence and scaled to a long one gives exactly
the bytes and FLOPs of a trace at the long one, untiled and tiled, for dense models and depth mixings; the
graph size, the one extrapolated figure (dispatched ops rather than make_fx nodes), stays close."""

import pytest

from megatrain.ir.scaled import Scale, choose_scale
from megatrain.ir.trace import chunk_candidates, trace
from megatrain.models import ModelConfig, preset

EXACT = ("flops_fwd", "flops_bwd", "saved_bytes", "peak_fwd_bytes", "peak_bwd_bytes", "rebuild_bytes")


def _config(name="tiny", **changes):
    return ModelConfig(**{**preset(name).model_dump(), "max_seq_len": 2**20, **changes})


def _assert_scaled_equals_direct(direct, scaled):
    assert scaled.traced_seq_len not in (None, direct.seq_len)
    assert direct.traced_seq_len is None
    for a, b in zip(direct.units, scaled.units):
        for field in EXACT:
            assert getattr(a, field) == getattr(b, field), (a.name, field)
        assert a.carry_out == b.carry_out and a.carry_in == b.carry_in
        # graph nodes, the one extrapolated figure: dispatched ops against make_fx's nodes (scaled.py)
        assert 0.6 * a.graph_nodes <= b.graph_nodes <= a.graph_nodes + 4, a.name


@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("name, dtype, batch", [("tiny", "fp32", 1), ("llama3-8b", "bf16", 1), ("tiny", "bf16", 2)])
def test_scaled_trace_equals_direct_trace(name, dtype, batch, chunk):
    c = _config(name)
    direct = trace(c, batch, 4096, dtype, chunk_tokens=chunk, scaled=False)
    scaled = trace(c, batch, 4096, dtype, chunk_tokens=chunk, scaled=True)
    _assert_scaled_equals_direct(direct, scaled)


@pytest.mark.parametrize("mixing", ["hc-dynamic:2", "depthssd:4", "attnres:3", "denseformer:2x2"])
def test_scaled_trace_equals_direct_for_depth_mixing(mixing):
    c = _config(n_layers=3, depth_mixing=mixing)
    for chunk in (None, 512):
        _assert_scaled_equals_direct(trace(c, 1, 4096, "fp32", chunk_tokens=chunk, scaled=False),
                                     trace(c, 1, 4096, "fp32", chunk_tokens=chunk, scaled=True))


@pytest.mark.parametrize("target, packed", [("cpu", False), ("cuda", True)])
def test_scaled_trace_equals_direct_for_cpu_kernels_and_packing(target, packed):
    c = _config()
    for chunk in (None, 1024):
        _assert_scaled_equals_direct(
            trace(c, 1, 6144, "bf16", target=target, packed=packed, chunk_tokens=chunk, scaled=False),
            trace(c, 1, 6144, "bf16", target=target, packed=packed, chunk_tokens=chunk, scaled=True))


def test_chunk_options_price_each_size_as_a_direct_trace_would():
    c = _config()
    ir = trace(c, 1, 8192, "bf16", chunk_options=True, scaled=True)
    assert ir.chunk_choices == (None, 4096, 2048, 1024, 512) and ir.chunk_tokens is None
    for chunk in (None, 2048, 512):
        direct = trace(c, 1, 8192, "bf16", chunk_tokens=chunk, scaled=False)
        got = ir.with_chunk(chunk)
        assert got.chunk_tokens == chunk
        for a, b in zip(direct.units, got.units):
            assert all(getattr(a, f) == getattr(b, f) for f in EXACT), (chunk, a.name)
    # the tiles' workspace shrinks with the chunk; their recompute costs backward FLOPs whatever the size
    block = [u for u in ir.units if u.kind == "block"][0]
    opts = {o.chunk_tokens: o for o in block.chunk_options}
    assert opts[512].peak_bwd_bytes < opts[4096].peak_bwd_bytes < opts[None].peak_bwd_bytes
    assert opts[512].flops_bwd == opts[4096].flops_bwd > opts[None].flops_bwd
    assert opts[512].flops_fwd == opts[None].flops_fwd


def test_long_sequences_trace_scaled_with_options_by_default():
    ir = trace(_config("llama3-8b"), 1, 2**20, "bf16")
    assert ir.traced_seq_len is not None and ir.chunk_choices[0] is None
    assert ir.chunk_choices[1:] == chunk_candidates(2**20) and max(ir.chunk_choices[1:]) == 2**19
    assert ir.units[1].carry_in[0].shape == (1, 2**20, 4096)
    short = trace(_config("llama3-8b"), 1, 8192, "bf16")
    assert short.traced_seq_len is None and short.chunk_choices == ()


def test_scale_avoids_every_model_dimension():
    s = choose_scale(2**20, 1, 1024, {2048, 4096, 1024, 14336}, chunked=True)
    assert s.seq % s.chunk == 0 and all(d % s.seq and d % s.chunk for d in (2048, 4096, 1024, 14336))
    assert Scale(3072, 768, 2).classify((2, 3072, 6144, 768, 1536, 1000)) == (2, 2)
    assert Scale(3072, 768, 1).scale_bytes((1, 1), 3072 * 768 * 4, 6144, 256) == 6144 * 256 * 4


def test_without_a_clean_short_length_a_default_trace_runs_as_is(monkeypatch):
    from megatrain.ir import trace as trace_module

    def none_found(*args, **kwargs):
        raise ValueError("found no short trace length")

    monkeypatch.setattr(trace_module, "choose_scale", none_found)
    ir = trace(_config(), 1, 16384, "bf16")
    assert ir.traced_seq_len is None and ir.chunk_choices == () and ir.units[1].carry_in[0].shape[1] == 16384
    with pytest.raises(ValueError, match="no short trace length"):
        trace(_config(), 1, 16384, "bf16", scaled=True)
