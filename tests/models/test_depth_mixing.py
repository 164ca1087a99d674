"""Depth mixing variants: their limits and identities (reference/depth_mixing.md §2-4).

- DepthSSD with N = 1 and a = B = C = 1 computes the residual model's loss bit for bit; the recurrent form (the units)
  and the dual form (the mixing matrix M) agree; M's semiseparable rank is N; the carry-in rebuilt from the
  carry-out matches to fp32 round-off.
- Static Hyper-Connections and DenseFormer at init compute the residual model's loss bit for bit (and its
  gradients: bit for bit for DenseFormer, to round-off for HC, whose backward sums n equal stream gradients).
- Every variant's parameter count matches its analytic formula and the traced IR.
"""

import math

import pytest
import torch

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, StepInputs, build_eager, preset, rope_tables
from megatrain.models.depth import depthssd, parse_depth

BASE = {**preset("tiny").model_dump(), "n_layers": 3}
VARIANTS = ["residual", "denseformer", "denseformer:2x2", "hc:4", "hc-dynamic:2", "attnres:3", "depthssd:4"]


def _config(mixing: str, **kw) -> ModelConfig:
    return ModelConfig(**{**BASE, "depth_mixing": mixing, **kw})


def _batch(config, seed=0, shape=(2, 24)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=g), torch.randint(0, config.vocab_size, shape, generator=g)


def _loss_and_grads(model, tokens, targets):
    loss = model(tokens, targets)
    names = [n for n, p in model.named_parameters() if ".mix." not in n]
    grads = torch.autograd.grad(loss, [model.get_parameter(n) for n in names])
    return loss, dict(zip(names, grads))


@pytest.mark.parametrize("mixing", ["hc:4", "hc:2", "denseformer", "denseformer:2x3"])
def test_static_variants_at_init_are_the_residual_model(mixing):
    tokens, targets = _batch(_config("residual"))
    want, want_g = _loss_and_grads(build_eager(_config("residual"), seed=1), tokens, targets)
    got, got_g = _loss_and_grads(build_eager(_config(mixing), seed=1), tokens, targets)
    assert torch.equal(got, want)
    for n in want_g:
        # HC's backward sums the n streams' gradients (equal values, other order): round-off, not bits
        assert (got_g[n] - want_g[n]).abs().max() <= 1e-6 * want_g[n].abs().max(), n
        if mixing.startswith("denseformer"):
            assert torch.equal(got_g[n], want_g[n]), n


def test_dynamic_hc_at_init_equals_static():
    tokens, targets = _batch(_config("hc:2"))
    s = build_eager(_config("hc:2"), seed=2)(tokens, targets)
    d = build_eager(_config("hc-dynamic:2"), seed=2)(tokens, targets)
    assert torch.equal(s, d)


def test_depthssd_rank_one_with_unit_coefficients_is_the_residual_model():
    tokens, targets = _batch(_config("residual"))
    want, want_g = _loss_and_grads(build_eager(_config("residual"), seed=1), tokens, targets)
    model = build_eager(_config("depthssd:1"), seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".theta"):
                p.fill_(-math.inf)  # a = 1 exactly
            elif ".mix." in n:
                p.fill_(1.0)
    got, got_g = _loss_and_grads(model, tokens, targets)
    assert torch.equal(got, want)
    for n in want_g:  # the backward associates the state's gradient sums differently: round-off
        assert (got_g[n] - want_g[n]).abs().max() <= 1e-6 * want_g[n].abs().max(), n
    # the init is not this point: a < 1 and B, C carry symmetry-breaking noise
    init = build_eager(_config("depthssd:4"), seed=1)
    a = depthssd.decay(init.blocks[0].mix.theta.detach())
    assert torch.all((a < 1) & (a > 0.99))
    assert init.blocks[0].mix.B[:, 1:].abs().max() > 0


def _capture(model, tokens):
    """Run the eager model recording each sub-layer's input h_l and output v_l, and the head's input."""
    c = model.config
    cos, sin = rope_tables(c, tokens.shape[1], torch.float32)
    inputs = StepInputs(tokens=tokens, cos=cos, sin=sin, target="cpu")
    hs, vs = [], [model.embed.embed_tokens(tokens)]

    def spy(f):
        def run(h):
            v = f(h)
            hs.append(h)
            vs.append(v)
            return v
        return run

    carry = model.embed((), inputs)
    for block in model.blocks:
        carry = block.mix(carry, tuple(spy(f) for f in block.sublayers(inputs)))
    hs.append(model.head.final(carry))
    return torch.stack(hs).double(), torch.stack(vs).double()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_depthssd_recurrent_and_dual_forms_agree_and_rank_is_n(n):
    model = build_eager(_config(f"depthssd:{n}"), seed=3)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():  # decays well below 1 and generic B, C so every term of M matters
        for name, p in model.named_parameters():
            if name.endswith(".theta"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif ".mix." in name:
                p.copy_(torch.randn(p.shape, generator=g))
    tokens, _ = _batch(model.config)
    with torch.no_grad():
        hs, vs = _capture(model, tokens)
        m = depthssd.model_mixing_matrix(dict(model.named_parameters()), model.config.n_layers)
    dual = torch.einsum("li,ibtd->lbtd", m[1:, :-1], vs)
    torch.testing.assert_close(dual, hs, rtol=1e-5, atol=1e-5)
    assert depthssd.semiseparable_rank(m) == n
    assert depthssd.semiseparable_rank(torch.tril(torch.ones(8, 8), -1)) == 1
    assert depthssd.semiseparable_rank(torch.tril(torch.randn(13, 13, dtype=torch.float64), -1)) == 6


def test_depthssd_state_write_gradients():
    args = (torch.randn(3, 2, 5, 4, dtype=torch.float64, requires_grad=True),
            torch.tensor(0.7, dtype=torch.float64, requires_grad=True),
            torch.randn(3, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(depthssd.StateWrite.apply, args)
    s, a, b, v = (x.detach() for x in args)
    torch.testing.assert_close(depthssd.StateWrite.apply(s, a, b, v), a * s + b.view(-1, 1, 1, 1) * v)


def test_depthssd_rebuild_recovers_the_carry_in():
    config = _config("depthssd:8")
    model = build_eager(config, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".theta"):
                p.fill_(1.0)  # a ≈ 0.34: rebuilding divides by it
    tokens, _ = _batch(config)
    cos, sin = rope_tables(config, tokens.shape[1], torch.float32)
    inputs = StepInputs(tokens=tokens, cos=cos, sin=sin, target="cpu")
    with torch.no_grad():
        carry = model.embed((), inputs)
        s_in = carry[0]
        block = model.blocks[0]
        out, side = block(carry, inputs, record=True)
        assert len(side) == 2 and side[0].shape == tokens.shape + (config.d_model,)
        rebuilt = block(out, inputs, rebuild=side)
        again = block(carry, inputs, side=side)
    torch.testing.assert_close(rebuilt[0], s_in, rtol=1e-5, atol=1e-6)
    assert torch.equal(again[0], out[0])


@pytest.mark.parametrize("mixing", VARIANTS)
def test_parameter_counts(mixing):
    config = _config(mixing)
    eager = sum(p.numel() for p in build_eager(config).parameters())
    ir = trace(config, 1, 16, "fp32", target="cpu")
    assert eager == config.n_params() == ir.params_total
    if mixing == "depthssd:4":
        assert eager - _config("residual").n_params() == (2 * 4 + 1) * 6 + 2 * 4
    if mixing == "denseformer":
        assert eager - _config("residual").n_params() == 3 * (3 + 3) // 2


def test_carry_bytes_follow_the_state():
    """What the IR records per unit: N fp32 copies for DepthSSD, n streams for HC, the stack for DenseFormer."""
    tokens_d = 16 * 128
    irs = {m: trace(_config(m), 1, 16, "bf16", target="cpu") for m in ("residual", "depthssd:8", "hc:4", "denseformer")}

    def carry(mixing, unit):
        return irs[mixing].unit(unit).carry_in_bytes
    assert carry("residual", "blocks.1") == tokens_d * 2
    assert carry("depthssd:8", "blocks.1") == 8 * tokens_d * 4
    assert carry("hc:4", "blocks.1") == 4 * tokens_d * 2
    # after block i: X_0..X_i that a later average reads, then Y_i; the head reads Y_D alone
    units = ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert [carry("denseformer", u) for u in units] == [tokens_d * 2 * k for k in (1, 3, 4, 1)]


@pytest.mark.parametrize("spec, error", [("depthssd:0", "between 1 and"), ("mixer", "unknown depth mixing"),
                                         ("denseformer:2y", "malformed"), ("residual:2", "malformed")])
def test_bad_specs_name_the_fix(spec, error):
    with pytest.raises(ValueError, match=error):
        parse_depth(spec)
    with pytest.raises(ValueError, match=error):
        _config(spec)


def test_attnres_blocks_must_divide_the_sublayers():
    with pytest.raises(ValueError, match="must divide the 6 sub-layers"):
        build_eager(_config("attnres:4"))
