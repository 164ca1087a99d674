"""Stochastic rounding of the bf16 policies' moments (megatrain/runtime/stochastic_round.py, host_kernel.c SR):
unbiased, special values kept, a pure function of (key, step, index in the parameter) whichever path, chunk or
shard computes it, and the C loop's bits equal to the torch path's.

Streamed against eager training under the bf16 policies is tests/runtime/test_host_policy.py (the store and the
reference key their parameters alike); sharded against eager is tests/runtime/test_distributed.py.
"""

import shutil

import pytest
import torch

from megatrain.planner.train import TrainSpec
from megatrain.runtime import host_adamw, host_kernel, host_state
from megatrain.runtime import stochastic_round as sr
from megatrain.runtime.host_adamw import grad_dtype, new_moments

CAN_BUILD = shutil.which("cc") is not None and torch.backends.cpu.get_cpu_capability() in host_kernel.LANES
CFG = TrainSpec(micro_batch=1, seq_len=1, weight_decay=0.1, betas=(0.9, 0.999))
BF16 = ("bf16-moments", "bf16")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).to(torch.int32) & 0xFFFF


def test_the_mean_of_many_roundings_is_the_value():
    """Values a fraction of the way between two bf16 neighbours (normal, negative, subnormal, beside the
    largest finite): the mean over 2^14 elements x 8 steps of their roundings is the value to within 5 standard
    errors, and each rounding is one of the two neighbours."""
    n = 1 << 14
    for lo, frac in ((1.0, 0.3), (-3.0, 0.001), (2.0**-130, 0.7), (0.75, 0.5), (-(2.0**100), 0.999)):
        lo_bf = torch.tensor(lo, dtype=torch.bfloat16)
        up = torch.tensor(lo_bf.view(torch.int16).item() + 1, dtype=torch.int16).view(torch.bfloat16)
        a, b = float(lo_bf), float(up)
        x = torch.full((n,), a + frac * (b - a))
        out = torch.empty(n, dtype=torch.bfloat16)
        total = 0.0
        for step in range(1, 9):
            sr.round_into(x, out, sr.draws(sr.step_seed(7, step), 0, n) & 0xFFFF)
            assert bool(((out.float() == a) | (out.float() == b)).all())
            total += float(out.double().sum())
        mean, se = total / (8 * n), abs(b - a) * (frac * (1 - frac) / (8 * n)) ** 0.5
        assert abs(mean - float(x[0].double())) <= 5 * se + 1e-3 * abs(b - a), (lo, frac)
    # both halves of the draw are uniform: m's (high) and v's (low) rounding up rates at a midpoint
    h = sr.draws(sr.step_seed(1, 1), 0, n)
    assert abs(float((h >> 16 >= 0x8000).double().mean()) - 0.5) < 0.01
    assert abs(float(((h & 0xFFFF) >= 0x8000).double().mean()) - 0.5) < 0.01


def test_special_values_round_as_c10_keeps_them():
    """A NaN of any sign or payload is 0x7FC0; infinities and zeros stay; a value that is already a bf16 stays
    whatever the draw; the largest finite rounds to its own sign's infinity, never into the sign bit."""
    x = host_kernel.special_values()
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    for r in (0, 0x7FFF, 0xFFFF):
        sr.round_into(x, out, torch.full((x.numel(),), r, dtype=torch.int64))
        u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        want = torch.where(torch.isnan(x), 0x7FC0, (u + r) >> 16)
        assert torch.equal(_bits(out).to(torch.int64), want)
        assert torch.equal(torch.signbit(out[~torch.isnan(x)]), torch.signbit(x[~torch.isnan(x)]))
    exact = x.to(torch.bfloat16).float()
    keep = (exact == x) & ~torch.isnan(x)
    sr.round_into(x, out, torch.full((x.numel(),), 0xFFFF, dtype=torch.int64))
    assert torch.equal(out.float()[keep], x[keep]) and bool(torch.isinf(out[x.abs() == 3.4028234663852886e38]).all())


def test_the_draws_are_a_function_of_key_step_and_index():
    """Draws for a range of a parameter equal the same elements of the whole parameter's; another step or key
    draws other bits; the tensor path's bits are the scalar definition's."""
    whole = sr.draws(sr.step_seed(11, 5), 0, 5000)
    assert torch.equal(sr.draws(sr.step_seed(11, 5), 1234, 700), whole[1234:1934])
    assert int(whole[77]) == sr.element_bits(sr.step_seed(11, 5), 77)
    assert sr.step_seed(0, 1) == sr.lowbias32(0x688990C0) and sr.lowbias32(1) == 0x688990C0  # pinned: a change moves every rounding
    assert float((sr.draws(sr.step_seed(11, 6), 0, 5000) == whole).double().mean()) < 0.01
    assert float((sr.draws(sr.step_seed(12, 5), 0, 5000) == whole).double().mean()) < 0.01
    assert sr.param_key("blocks.0.attn.wq") != sr.param_key("blocks.0.attn.wk")


def _train(policy, shapes, one_pass, clip, keys, origins, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    moments = [new_moments(policy, s, k) for s, k in zip(shapes, keys)]
    for m, o in zip(moments, origins):
        m.origin = o
    counts = [torch.zeros(()) for _ in shapes]
    for k in range(steps):
        grads = [(torch.randn(s, generator=gen) * 10.0**-k).to(grad_dtype(policy)) for s in shapes]
        host_state._step(policy, params, grads, moments, counts, CFG, 1e-3, [True, False], clip, one_pass)
    return params, moments


def _flat(params, moments):
    return [*params, *(t for m in moments for t in (m.exp_avg, m.exp_avg_sq))]


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", BF16)
@pytest.mark.parametrize("clip", [None, 0.37])
def test_the_kernel_rounds_as_the_torch_path(policy, clip):
    """C loop (vector body and scalar tail) against torch ops, bit for bit: keyed parameters at non-zero
    origins, clipped and not, fp32 and bf16 (the bf16 policy's) gradients."""
    assert host_kernel.available(), host_kernel.why_not()
    shapes, keys, origins = [(3 * 256 + 13,), (40, 17)], ["blocks.0.w1", "head.norm"], [0, 5 * 2**30 + 3]
    factor = None if clip is None else torch.tensor(clip)
    ref = _flat(*_train(policy, shapes, False, factor, keys, origins))
    got = _flat(*_train(policy, shapes, True, factor, keys, origins))
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), f"{policy}: tensor {i}"
    # not vacuous: another key rounds some moments the other way
    other = _flat(*_train(policy, shapes, True, factor, ["x", "y"], origins))
    assert any(not torch.equal(a, b) for a, b in zip(got[2:], other[2:]))


@pytest.mark.parametrize("one_pass", [False, True])
def test_a_shard_steps_as_the_same_elements_of_its_parameter(one_pass):
    """A parameter stepped whole and as two slices (a data-parallel shard's cut, at its origin) ends with the
    same weights and moments, element for element, and two runs are identical."""
    if one_pass and not (CAN_BUILD and host_kernel.available()):
        pytest.skip("no kernel on this machine")
    n, cut = 2000, 1024  # a cut on a 16-element boundary: the slices' vector bodies and tails are the whole's
    whole = _train("bf16", [(n,), (n,)], one_pass, None, ["p", "q"], [0, 0])
    again = _train("bf16", [(n,), (n,)], one_pass, None, ["p", "q"], [0, 0])
    assert all(torch.equal(a, b) for a, b in zip(_flat(*whole), _flat(*again)))
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen) * 0.02
    torch.randn(n, generator=gen)  # the second parameter's weights in the whole run
    params, moments = [p0[:cut].clone(), p0[cut:].clone()], [new_moments("bf16", (cut,), "p"),
                                                             new_moments("bf16", (n - cut,), "p")]
    moments[1].origin = cut
    counts = [torch.zeros(()), torch.zeros(())]
    for k in range(3):
        g = (torch.randn(n, generator=gen) * 10.0**-k).bfloat16()
        torch.randn(n, generator=gen)  # the second parameter's draw in the whole run
        host_state._step("bf16", params, [g[:cut], g[cut:]], moments, counts, CFG, 1e-3, [True, True], None,
                         one_pass)
    assert torch.equal(torch.cat(params), whole[0][0])
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(torch.cat([getattr(m, name) for m in moments]), getattr(whole[1][0], name))


def test_the_second_moment_follows_small_steps_at_beta2_0_999():
    """What round-to-nearest got wrong: v's steps of a thousandth of itself. With a constant gradient v tends
    to g^2 from below; after 2000 steps from v = 4 g^2 the rounded v is within 1% of the fp32 recursion's,
    where round-to-nearest stayed at its start."""
    n = 4096
    m = host_adamw.Moments(torch.zeros(n, dtype=torch.bfloat16), torch.full((n,), 4.0, dtype=torch.bfloat16))
    exact = 4.0
    for step in range(1, 2001):
        v = m.exp_avg_sq.float() * 0.999 + 0.001
        sr.round_into(v, m.exp_avg_sq, sr.draws(sr.step_seed(0, step), 0, n) & 0xFFFF)
        exact = exact * 0.999 + 0.001
    assert abs(float(m.exp_avg_sq.float().mean()) / exact - 1) < 0.01
    assert torch.tensor(4.0 * 0.999 + 0.001).bfloat16().item() == 4.0  # round-to-nearest's fixed point
