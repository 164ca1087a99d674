"""Host policies at run time: streamed training under each policy equals eager training under it bit for bit,
the host bytes allocated equal the plan's, and the pieces (fp8 blocks, the clip factor) do what
megatrain/runtime/host_adamw.py says.

The streamed side is the host store on the sim device; the eager side is reference.PolicyAdamW, the same
host_state.adamw_step on the eager model's parameters. `exact` against torch.optim.AdamW is
tests/runtime/test_exactness.py.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from runtime_schedules import make_batches, plans_by_shape, streamed_train
from torch.optim.adamw import adamw as functional_adamw

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec, hardware_preset, plan
from megatrain.planner.host_policy import FP8_BLOCK, POLICIES
from megatrain.runtime import host_adamw, host_state
from megatrain.runtime.engine import Engine
from megatrain.runtime.host_adamw import Moments, new_moments
from megatrain.runtime.host_state import adamw_step
from megatrain.runtime.reference import eager_train
from megatrain.runtime.store import HostStore
from megatrain.runtime.stream_device import SimDevice

TINY = preset("tiny")
COMPRESSED = [n for n in POLICIES if n != "exact"]


def _train(grad_accum, clip, dtype="fp32"):
    return TrainSpec(micro_batch=2, seq_len=64, grad_accum=grad_accum, dtype=dtype, lr=2e-3, warmup_steps=1,
                     total_steps=3, weight_decay=0.1, clip_norm=clip)


@pytest.mark.parametrize("policy", COMPRESSED)
@pytest.mark.parametrize("grad_accum, clip", [(1, None), (3, 0.05)])
def test_streamed_equals_eager_under_each_policy(policy, grad_accum, clip):
    """clip 0.05 clips every step (the factor is < 1), so the clip multiply is exercised."""
    train = _train(grad_accum, clip)
    batches = make_batches(TINY, train, steps=3)
    model, eager_losses = eager_train(TINY, batches, train, host_policy=policy)
    exact, _ = eager_train(TINY, batches, train)
    plans = plans_by_shape(TINY, train, budgets_mib=(4, 5, 5.25, 5.5, 6, 8, 64), host_policy=policy)
    assert {n for n, _ in plans} >= {1, 2} and all(p.host_policy == policy for p in plans.values())
    for p in plans.values():
        store, losses, _ = streamed_train(p, batches)
        assert losses == eager_losses
        master = store.named_master()
        for name, param in model.named_parameters():
            assert torch.equal(master[name], param.detach()), f"{policy}: {name} differs from eager under it"
    # not vacuous: the policy's rounding changed the weights relative to exact AdamW
    differs = [n for n, q in exact.named_parameters() if not torch.equal(q, dict(model.named_parameters())[n])]
    assert len(differs) > len(list(exact.parameters())) // 2


@pytest.mark.parametrize("policy", list(POLICIES))
def test_bf16_loads_cast_the_master_through_the_staging_ring(policy, monkeypatch):
    """bf16 compute keeps no transfer copy: each load casts the fp32 master, chunk by chunk through the two
    staging buffers (small here, so a unit takes several chunks), and a tied head takes its shared weight
    from the embedding's master. What lands in the slot is exactly the master cast to bf16."""
    import megatrain.planner.host_policy as hp

    monkeypatch.setattr(hp, "STAGE_ELEMS", 5000)
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 2, "tie_embeddings": True})
    train = _train(2, 1.0, dtype="bf16")
    p = plan(trace(config, 2, 64, "bf16", target="cpu"), hardware_preset("cpu"), train, 4 * 2**20,
             host_policy=policy)
    assert p.host_breakdown["transfer_staging"] == 2 * 2 * 5000
    batches = make_batches(config, train, steps=2)
    store, losses, _ = streamed_train(p, batches)
    assert all(torch.isfinite(torch.tensor(losses)))
    masters = store.named_master()
    with SimDevice() as dev:
        for u in p.ir.units:
            slot = torch.full((u.flat_numel,), float("nan"), dtype=torch.bfloat16)
            store.load_params(u.name, slot, dev)
            for q in u.params:
                want = masters[u.tied.get(q.name, f"{u.name}.{q.name}")].reshape(-1).to(torch.bfloat16)
                assert torch.equal(slot[q.offset : q.offset + q.numel], want), (u.name, q.name)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("dtype, clip", [("fp32", None), ("fp32", 1.0), ("bf16", None)])
def test_allocated_host_bytes_equal_the_plan(policy, dtype, clip):
    """Every host byte the run allocates (the store's arena: pinned region and pageable buffers) equals the
    plan's host bytes, component by component, and the arena's count equals the storages it hands out."""
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 3})
    train = _train(2, clip, dtype)
    ir = trace(config, 2, 64, train.dtype, target="cpu")
    plans = plans_by_shape(config, train, budgets_mib=(4, 4.5, 5, 5.5, 6, 7), host_policy=policy).values()
    p = next(q for q in plans if any(i.op == "offload_act" for i in q.program.instrs))  # checkpoints count too
    with SimDevice(p.gpu_budget_bytes) as dev:
        store = HostStore(ir, train, policy=policy, program=p.program, device=dev.kind)
        Engine(ir, p.program, dev, store)
        assert store.host_bytes() == p.host_bytes
        assert store.arena.by_component == {k: v for k, v in p.host_breakdown.items() if v}
        seen = {}
        for t in _store_tensors(store):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        assert sum(seen.values()) == store.host_bytes()


def test_host_buffers_are_advised_huge_pages_before_first_touch(monkeypatch):
    """host_memory.advise_huge_pages: madvise(MADV_HUGEPAGE) on exactly the whole 2 MiB pages inside a tensor
    (none for a smaller one), and the arena advises every buffer it hands out, the pinned region included,
    before registering it."""
    from megatrain.runtime import host_memory as hm

    calls = []

    class Libc:
        @staticmethod
        def madvise(addr, length, advice):
            calls.append((addr, length, advice))
            return 0

    monkeypatch.setattr(hm, "_libc", Libc)
    monkeypatch.setattr(hm.sys, "platform", "linux")
    t = torch.empty(3 * hm.HUGE_PAGE + 12345, dtype=torch.uint8)
    assert hm.advise_huge_pages(t)
    (addr, length, advice), = calls
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    assert advice == hm.MADV_HUGEPAGE and addr % hm.HUGE_PAGE == 0 and length % hm.HUGE_PAGE == 0
    assert start <= addr < start + hm.HUGE_PAGE and end - hm.HUGE_PAGE < addr + length <= end
    assert not hm.advise_huge_pages(torch.empty(1000)) and len(calls) == 1  # no whole huge page inside
    advised = []
    monkeypatch.setattr(hm, "advise_huge_pages", lambda x: advised.append(x.data_ptr()) or True)
    arena = hm.HostArena("sim")
    out = arena.allocate([hm.HostBuffer("a", "moments", (1 << 20,), torch.float32, False),
                          hm.HostBuffer("b", "master_fp32", (1 << 20,), torch.float32, True),
                          hm.HostBuffer("c", "grads", (1000,), torch.bfloat16, True)])
    assert out["a"].data_ptr() in advised and len(advised) == 2  # the pageable buffer and the one region
    assert arena._regions[0].data_ptr() in advised


@pytest.mark.parametrize("policy", ["exact", "fp8"])
def test_a_tied_head_holds_no_host_state_for_the_shared_weight(policy):
    """The head borrows the embedding's weight: its master and moments hold only its own parameters (the
    final norm), while its gradient buffer keeps the tied slice the embedding's gradient takes; the host bytes
    still equal the plan's, and training under it still equals eager (tests/runtime/test_exactness.py)."""
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 2, "tie_embeddings": True})
    train = _train(2, 1.0)
    ir = trace(config, 2, 64, train.dtype, target="cpu")
    head = ir.units[-1]
    assert head.tied and head.host_numel == head.n_params <= head.flat_numel - config.vocab_size * config.d_model
    p = next(iter(plans_by_shape(config, train, budgets_mib=(64,), host_policy=policy).values()))
    with SimDevice(p.gpu_budget_bytes) as dev:
        store = HostStore(ir, train, policy=policy, program=p.program, device=dev.kind)
        Engine(ir, p.program, dev, store)
        st = store.units[head.name]
        assert st.master.numel() == head.n_params and st.moments[0].exp_avg.numel() == head.n_params
        assert store.host_bytes() == p.host_bytes
    untied = trace(ModelConfig(**{**config.model_dump(), "tie_embeddings": False}), 2, 64, train.dtype,
                   target="cpu")
    saved = untied.units[-1].host_numel - head.host_numel  # the vocab x d weight, less the alignment padding
    assert saved >= config.vocab_size * config.d_model


def _store_tensors(store):
    for st in store.units.values():
        yield st.master
        yield st.buffers
        for m in st.moments:
            yield from m.tensors().values()
        yield from st.steps
    yield from store.grad_buffers
    yield from store.stage
    for ts in store.host_acts.values():
        yield from ts


def test_policies_bytes_per_param():
    want = {"exact": (12, 16), "bf16-moments": (8, 12), "bf16": (8, 10), "fp8": (6 + 1 / 32, 8 + 1 / 32)}
    assert {n: (p.bytes_per_param(False), p.bytes_per_param(True)) for n, p in POLICIES.items()} == want
    assert {n: p.traffic for n, p in POLICIES.items()} == {"exact": 28, "bf16-moments": 20, "bf16": 18,
                                                            "fp8": 14 + 1 / 16}


def test_fp8_blocks_round_trip_and_floor():
    """Blocks of FP8_BLOCK from the parameter's first element, scale = the block's amax / 448: values within
    1/16 of themselves (3 mantissa bits), an all-zero block keeps scale 0, the second moment never dequantises
    to 0 inside a non-zero block."""
    torch.manual_seed(0)
    n = 3 * FP8_BLOCK + 17
    x = torch.randn(n) * torch.logspace(-3, 0, n)
    x[FP8_BLOCK : 2 * FP8_BLOCK] = 0.0
    q, scale = torch.empty(n, dtype=torch.float8_e4m3fn), torch.empty(4)
    host_adamw._quant(x.clone(), q, scale)
    assert scale[1] == 0 and (scale[[0, 2, 3]] > 0).all()
    back = torch.empty(n)
    host_adamw._dequant(q, scale, back, floor=False)
    big = x.abs() >= torch.repeat_interleave(scale, FP8_BLOCK)[:n] * 2**-6  # normal fp8 range
    assert big.sum() > n // 2
    torch.testing.assert_close(back[big], x[big], rtol=1 / 16, atol=0)
    assert (back[FP8_BLOCK : 2 * FP8_BLOCK] == 0).all()
    sq = x.square()
    host_adamw._quant(sq.clone(), q, scale)
    host_adamw._dequant(q, scale, back, floor=True)
    nonzero = torch.repeat_interleave(scale, FP8_BLOCK)[:n] > 0
    assert (back[nonzero] > 0).all() and (back[~nonzero] == 0).all()


def _fp32(x: Fraction) -> np.float32:
    """The fp32 nearest the rational x, ties to even (exactly: not through a float64)."""
    f = np.float32(float(x))
    if Fraction(float(f)) > x:
        down, up = np.nextafter(f, np.float32(-np.inf)), f
    else:
        down, up = f, np.nextafter(f, np.float32(np.inf))
    lo, hi = x - Fraction(float(down)), Fraction(float(up)) - x
    return down if lo < hi or (lo == hi and int(down.view(np.uint32)) % 2 == 0) else up


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fp8_weight_update_is_its_formula_in_fp32(wd):
    """fp8's weight update from its updated moments (host_adamw._fp8_update, host_kernel.c FP8_UPDATE) against
    its formula in exact rationals, each operation rounded once to fp32: den = fma(sqrt(v), 1 / sqrt(bc2), eps),
    p' = fma(p, 1 - lr wd, ((-lr / bc1) m) / den), on sizes with vector bodies and tails, v from subnormal to
    large; the square root is numpy's (IEEE, correctly rounded), the fused multiply-adds are Fractions."""
    gen = torch.Generator().manual_seed(4)
    cfg = TrainSpec(micro_batch=1, seq_len=1, weight_decay=wd)
    lr, step = 3e-3, 7.0
    f = np.float32
    b1, b2 = cfg.betas
    inv, eps, step_size = (Fraction(float(f(x))) for x in (1 / math.sqrt(1 - b2**step), cfg.eps, -(lr / (1 - b1**step))))
    decay = Fraction(float(f(1 - lr * wd)))
    for n in (1, 13, 1000, 1500):
        p, m = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
        v = torch.rand(n, generator=gen) * torch.logspace(-44, 2, n)
        want = []
        for pi, mi, vi in zip(p.tolist(), m.tolist(), np.sqrt(v.numpy()).tolist()):
            den = _fp32(Fraction(vi) * inv + eps)
            u = _fp32(Fraction(float(_fp32(Fraction(mi) * step_size))) / Fraction(float(den)))
            want.append(_fp32(Fraction(pi) * decay + Fraction(float(u))))
        want = np.array(want, dtype=np.float32)
        host_adamw._fp8_update(p, m, v, torch.empty(n), torch.empty(n), cfg, lr, wd, step)
        assert np.array_equal(p.numpy().view(np.uint32), want.view(np.uint32)), n


def test_fma32_is_one_rounding():
    """host_adamw._fma32 against exact rationals where fp64 alone rounds twice: products whose sum lands
    within an fp64 ulp of an fp32 midpoint, cancellations, signed zeros and non-finite operands."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(4000).astype(np.float32)
    b = np.float32(1 - 2**-18)
    # c puts a b + c next to fp32 midpoints: -(a b rounded to fp32) + half an ulp of it, nudged
    ab = (a.astype(np.float64) * np.float64(b)).astype(np.float32)
    c = (-ab + np.spacing(ab) / 2 * rng.choice([-1, 1], a.size)).astype(np.float32)
    c[:100] = (-a[:100] * b).astype(np.float32)  # cancellations to about an ulp
    # |a b + c| = (an fp32 midpoint) - 2^-60 with c odd in [1, 2) and a b = +-2^-24 (1 - 2^-36): fp64 rounds it to
    # the midpoint, then to even, away from c, where one rounding goes to c (fp64's sum alone: all 1000 wrong)
    k = 1000
    odd = (rng.integers(0, 2**22, k) * 2 + 1 + 127 * 2**23).astype(np.uint32).view(np.float32)
    c[-k:] = odd * rng.choice([-1, 1], k).astype(np.float32)
    a[-k:] = np.float32(2**-24 * (1 + 2**-18)) * np.sign(c[-k:])
    out = np.empty_like(a)
    host_adamw._fma32(a, float(b), c, out)
    want = [_fp32(Fraction(x) * Fraction(float(b)) + Fraction(y)) for x, y in zip(a.tolist(), c.tolist())]
    assert np.array_equal(out.view(np.uint32), np.array(want, dtype=np.float32).view(np.uint32))
    special = np.array([0.0, -0.0, np.inf, np.nan, 1.0], dtype=np.float32)
    out = np.empty(5, dtype=np.float32)
    host_adamw._fma32(special, -1.0, np.array([0.0, -0.0, 1.0, 1.0, -1.0], dtype=np.float32), out)
    assert out[0] == 0 and not np.signbit(out[0]) and out[1] == 0 and not np.signbit(out[1])  # -0 + 0, +0 + -0
    assert out[2] == -np.inf and np.isnan(out[3]) and out[4] == -2


@pytest.mark.parametrize("policy", list(POLICIES))
def test_step_does_not_depend_on_the_chunk_size(policy, monkeypatch):
    """Chunks only bound the scratch: elementwise math and blocks inside chunks give the same bits."""
    cfg = TrainSpec(micro_batch=1, seq_len=8, lr=1e-2, clip_norm=1.0)

    def run(chunk):
        monkeypatch.setattr(host_adamw, "STEP_CHUNK", chunk)
        torch.manual_seed(0)
        shapes = [(700, 5), (33,), (4 * FP8_BLOCK,)]
        params = [torch.randn(s) for s in shapes]
        moments = [new_moments(policy, s) for s in shapes]
        steps = [torch.zeros(()) for _ in shapes]
        for _ in range(3):
            grads = [torch.randn(s).to(host_adamw.grad_dtype(policy)) for s in shapes]
            adamw_step(policy, params, grads, moments, steps, cfg, 1e-2, [True, False, True], torch.tensor(0.3))
        return params, moments, steps

    a, b = run(host_adamw.STEP_CHUNK), run(2 * FP8_BLOCK)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for m, n in zip(a[1], b[1]):
        assert all(torch.equal(s.float(), t.float()) for s, t in zip(m.tensors().values(), n.tensors().values()))
    assert [float(s) for s in a[2]] == [3.0, 3.0, 3.0]


def test_grad_scale_divides_so_exact_keeps_the_multiply():
    """Why no policy folds the clip factor into the fused kernel's grad_scale: the kernel divides by it,
    and g / (1 / c) rounds differently from clip_grad_norm_'s g * c. What exact does instead, g * c into a
    scratch chunk, is bit-identical to clipping first."""
    cfg = TrainSpec(micro_batch=1, seq_len=8, lr=1e-2)
    torch.manual_seed(0)
    n = 100_003
    p0, g = torch.randn(n), torch.randn(n)
    c = torch.tensor(0.37)

    def fresh():
        return [p0.clone()], [Moments(torch.zeros(n), torch.zeros(n))], [torch.zeros(())]

    params, moms, steps = fresh()
    host_adamw._fused(params, [g * c], [moms[0].exp_avg], [moms[0].exp_avg_sq], steps, cfg, 1e-2, 0.1)
    clipped_first = params[0]
    params, moms, steps = fresh()
    functional_adamw(params, [g.clone()], [moms[0].exp_avg], [moms[0].exp_avg_sq], [], steps, fused=True,
                     amsgrad=False, beta1=cfg.betas[0], beta2=cfg.betas[1], lr=1e-2, weight_decay=0.1, eps=cfg.eps,
                     maximize=False, grad_scale=torch.reciprocal(c))
    assert not torch.equal(params[0], clipped_first)  # folding changes the rounding
    params, moms, steps = fresh()
    adamw_step("exact", params, [g.clone()], moms, steps, cfg, 1e-2, clip=c)
    assert torch.equal(params[0], clipped_first)



@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_clips_as_clip_grad_norm_multiplies(policy, one_pass):
    """A clipped step under any policy is its unclipped step on the fp32 gradient times the factor, rounded
    once in fp32 (clip_grad_norm_'s g * c): the policies differ from exact in what they store, not in how they
    clip. Through host_kernel.c and through torch ops; a bf16-held gradient is upcast before the multiply."""
    from megatrain.runtime import host_kernel

    if one_pass and not host_kernel.available():
        pytest.skip(f"host_kernel.c is off here: {host_kernel.why_not()}")
    cfg = TrainSpec(micro_batch=1, seq_len=8, lr=1e-2)
    torch.manual_seed(0)
    shapes = [(3 * FP8_BLOCK + 77,), (64, 33)]
    p0 = [torch.randn(s) for s in shapes]
    g = [torch.randn(s).to(host_adamw.grad_dtype(policy)) for s in shapes]
    c = torch.tensor(0.37)

    def stepped(grads, clip):
        params, moms, steps = [p.clone() for p in p0], [new_moments(policy, s) for s in shapes], \
            [torch.zeros(()) for _ in shapes]
        for _ in range(2):  # the second step reads moments the first one stored
            host_state._step(policy, params, [x.clone() for x in grads], moms, steps, cfg, 1e-2, None, clip,
                             one_pass)
        return params, moms

    clipped, moms = stepped(g, c)
    first, moms_first = stepped([x.float() * c for x in g], None)
    unclipped, _ = stepped(g, None)
    for a, b, u in zip(clipped, first, unclipped):
        assert torch.equal(a, b)
        assert not torch.equal(a, u)  # the factor did something
    for m, n in zip(moms, moms_first):
        assert torch.equal(m.exp_avg.float(), n.exp_avg.float()) and torch.equal(m.exp_avg_sq.float(), n.exp_avg_sq.float())


# -- checkpoints -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


def _trainer(token_files, policy, **kw):
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    spec = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", lr=3e-3, warmup_steps=1, total_steps=4, clip_norm=1.0)
    return Trainer(RunConfig(model=TINY, train=spec, gpu_mem=6 * 2**20, data=token_files[0], host_policy=policy,
                             device="sim", **kw))


def _state(store):
    return {k: v.clone() for unit in store.units for k, v in store.state_tensors(unit).items()}


@pytest.mark.parametrize("policy", ["bf16", "fp8"])
def test_checkpoints_save_and_resume_each_policy_exactly(token_files, tmp_path, policy):
    """Moments in their stored dtype (fp8 with its scales) round-trip, and a resumed run ends bit-identical to
    one that never stopped. Resuming under another policy is refused in one line; auto takes the checkpoint's."""
    from safetensors import safe_open

    from megatrain.runtime.checkpoint import CheckpointError

    with _trainer(token_files, policy) as t:
        t.run(4, progress=False)
        straight = _state(t.store)
    with _trainer(token_files, policy, checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(2, progress=False)
    ckpt = tmp_path / "step-00000002"
    with safe_open(ckpt / "blocks.0.safetensors", "pt") as f:
        name = "blocks.0.mlp.up_proj.weight"
        assert f.get_tensor(f"exp_avg/{name}").dtype == host_adamw.moment_dtype(policy)
        assert (f"exp_avg_scale/{name}" in f.keys()) == (policy == "fp8")
    with pytest.raises(CheckpointError, match=rf"under host policy '{policy}', this run under 'exact'.*"
                       rf"--host-policy {policy}") as e:
        _trainer(token_files, "exact", resume=tmp_path)
    assert "\n" not in str(e.value)
    with _trainer(token_files, "auto", resume=tmp_path) as t:
        assert t.plan.host_policy == policy and t.step == 2
        t.run(2, progress=False)
        resumed = _state(t.store)
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k].reshape(-1).view(torch.uint8), resumed[k].reshape(-1).view(torch.uint8)), k


def test_the_device_norm_is_clip_grad_norms_to_the_bit():
    """clip_grads combines per-parameter norms the device computed as each unit's gradients became final:
    the global norm equals torch.nn.utils.clip_grad_norm_'s (foreach norms, then the norm of norms), bit for
    bit. A clip of 1e9 leaves the gradients untouched, so eager's last gradients are there to norm again."""
    from megatrain.runtime.reference import EagerTrainer

    train = _train(3, 1e9)
    batches = make_batches(TINY, train, steps=2)
    eager = EagerTrainer(TINY, train)
    for b in batches:
        eager.step(b)
    want = torch.nn.utils.get_total_norm([p.grad for p in eager.model.parameters()])
    p = next(iter(plans_by_shape(TINY, train, budgets_mib=(8,)).values()))
    store, _, _ = streamed_train(p, batches)
    assert store.last_grad_norm == float(want) and store.last_grad_norm > 0
