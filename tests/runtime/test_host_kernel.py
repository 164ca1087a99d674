"""The one-pass host optimizer (megatrain/runtime/host_kernel.c): the same bits as the torch-op path for every policy,
whatever the tensor sizes, clip factor, thread split and value range; a machine where it cannot be built or
its bits differ falls back to the torch path and says why.

`exact` through the kernel against torch.optim.AdamW(fused=True) on a model's parameters is
tests/runtime/test_exactness.py (it runs whichever path this machine uses).
"""

import os
import shutil

import kernel_checks
import pytest
import torch

from megatrain.planner.host_policy import FP8_BLOCK, POLICIES
from megatrain.planner.train import TrainSpec
from megatrain.runtime import host_adamw, host_kernel, host_state
from megatrain.runtime.host_adamw import grad_dtype, new_moments
from megatrain.runtime.host_state import adamw_step

CAPABLE = torch.backends.cpu.get_cpu_capability() in host_kernel.LANES
CAN_BUILD = shutil.which("cc") is not None and CAPABLE
CFG = TrainSpec(micro_batch=1, seq_len=1, weight_decay=0.1)


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """host_kernel's module state emptied for the test (built into a temp cache) and put back after it."""
    saved = dict(host_kernel._state)
    host_kernel._state.clear()
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache" / "kernels"
    host_kernel._state.clear()
    host_kernel._state.update(saved)


def _state(policy, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    return gen, params, [new_moments(policy, s) for s in shapes], [torch.zeros(()) for _ in shapes]


def _run(policy, shapes, clips, one_pass, scale=1.0, seed=0, cfg=CFG):
    gen, params, moments, steps = _state(policy, shapes, seed)
    decay = [i % 2 == 0 for i in range(len(shapes))]
    for clip in clips:
        grads = [(torch.randn(s, generator=gen) * scale).to(grad_dtype(policy)) for s in shapes]
        host_state._step(policy, params, grads, moments, steps, cfg, 3e-3, decay, clip, one_pass)
    return [*params, *(t for m in moments for t in m.tensors().values()), *steps]


def _assert_same_bits(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{what}: tensor {i}"


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_kernel_is_used_on_this_machine():
    """Where it can be built, it must pass its own check: a silent fallback would hide a broken kernel."""
    assert host_kernel.available(), host_kernel.why_not()


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", list(POLICIES))
def test_one_pass_equals_torch_ops(policy):
    """Sizes around every boundary (the 8-element tail, 16-lane vectors, fp8 blocks), several steps with the
    clip factor off, < 1, and exactly 1; gradients from ordinary to ones whose squares are subnormal."""
    assert host_kernel.available(), host_kernel.why_not()
    shapes = [(1,), (7,), (8,), (15,), (17,), (FP8_BLOCK - 1,), (FP8_BLOCK,), (FP8_BLOCK + 9,), (33, 31),
              (5 * FP8_BLOCK + 23,)]
    clips = [None, torch.tensor(0.31), torch.tensor(1.0), None, torch.tensor(0.07)]
    for scale in (1.0, 1e-3, 1e-21):
        ref = _run(policy, shapes, clips, one_pass=False, scale=scale)
        got = _run(policy, shapes, clips, one_pass=True, scale=scale)
        _assert_same_bits(ref, got, f"{policy} at gradient scale {scale}")
        changed = sum(not torch.equal(a, b) for a, b in zip(ref[: len(shapes)], _state(policy, shapes, 0)[1]))
        # not vacuous: every parameter moved (at 1e-21 the update is below an ulp of the weights: the decayed
        # ones move, by the decay)
        assert changed == (len(shapes) if scale >= 1e-3 else (len(shapes) + 1) // 2)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", list(POLICIES))
def test_non_finite_and_overflowing_values_give_the_same_bits(policy):
    """Blocks holding a NaN or an inf (fp8: the store's full conversion, not its finite fast path), gradients
    whose squares overflow fp32, and ordinary blocks beside them in the same tensor."""
    assert host_kernel.available(), host_kernel.why_not()
    _assert_same_bits_but_nans(policy)


def _assert_same_bits_but_nans(policy):
    shapes = [(4 * FP8_BLOCK + 3,), (FP8_BLOCK - 5,)]
    runs = []
    for one_pass in (False, True):
        gen, params, moments, steps = _state(policy, shapes, 3)
        for k, clip in enumerate([None, torch.tensor(0.5), None]):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            grads[0][FP8_BLOCK + 1] = float("nan") if k == 0 else 1.0
            grads[0][2 * FP8_BLOCK + 7] = float("-inf") if k == 1 else -2.0
            grads[0][3 * FP8_BLOCK : 3 * FP8_BLOCK + 9] *= 1e25  # squares beyond fp32: v is inf there
            grads[1][-3:] *= 1e30
            grads = [g.to(grad_dtype(policy)) for g in grads]
            host_state._step(policy, params, grads, moments, steps, CFG, 3e-3, [True, False], clip, one_pass)
        runs.append([*params, *(t for m in moments for t in m.tensors().values())])
    # a NaN's sign and payload are not compared (torch's conversions keep them, c10's scalar ones do not):
    # NaN where the other has NaN, every other element bit for bit
    nan = [[torch.isnan(t.float()) for t in run] for run in runs]
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(nan[0][i], nan[1][i]), f"{policy}: NaNs of tensor {i}"
        keep = ~nan[0][i]
        _assert_same_bits([a[keep]], [b[keep]], f"{policy}: tensor {i}")
    assert any(x.any() for x in nan[0]) and not all(x.all() for x in nan[0])  # not vacuous


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("at", [0, 1, 17, FP8_BLOCK - 1])
def test_a_nan_gradient_in_a_fresh_block_gives_the_same_bits(at):
    """A NaN gradient in a full block whose moments' codes hold no NaN (the vector loop takes it), one step
    from fresh moments: the block's first moment has amax NaN, as torch.amax says. The vector loop's vrangeps
    drops NaNs, and until 2026-12-04 that block kept a finite scale and codes the torch path does not give."""
    assert host_kernel.available(), host_kernel.why_not()
    n = 4 * FP8_BLOCK
    runs = []
    for one_pass in (False, True):
        torch.manual_seed(0)
        params, grads = [torch.randn(n)], [torch.randn(n).bfloat16()]
        grads[0][FP8_BLOCK + at] = float("nan")
        moments, steps = [new_moments("fp8", (n,))], [torch.zeros(())]
        host_state._step("fp8", params, grads, moments, steps, CFG, 1e-3, [True], None, one_pass)
        runs.append([params[0], *moments[0].tensors().values()])
    assert torch.isnan(runs[0][3][1]) and not torch.isnan(runs[0][3][[0, 2, 3]]).any()  # avg_scale: block 1
    for i, (a, b) in enumerate(zip(*runs)):
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float())), f"NaNs of tensor {i}"
        _assert_same_bits([a[~nan]], [b[~nan]], f"tensor {i}")


def _fp8_steps_from(every: torch.Tensor, avg_scales: list[float], sq_scales: list[float], seed: int) -> list:
    """One fp8 step of two tensors of every's size, through the torch path then the kernel, from stored codes:
    tensor 0's first moment `every` and second moment an ordinary (normal, positive) code per element, tensor 1
    the other way round, with the given per-block scales; per path, the params then every moment tensor."""
    shapes = [every.shape, every.shape]
    ordinary = (every & 0x3F) | 0x08
    runs = []
    for one_pass in (False, True):
        gen, params, moments, steps = _state("fp8", shapes, seed)
        for mom, (m, v) in zip(moments, [(every, ordinary), (ordinary, every)]):
            mom.exp_avg.view(torch.uint8).copy_(m)
            mom.exp_avg_sq.view(torch.uint8).copy_(v)
            mom.avg_scale.copy_(torch.tensor(avg_scales))
            mom.sq_scale.copy_(torch.tensor(sq_scales))
        steps = [torch.ones(()) for _ in shapes]
        grads = [torch.randn(s, generator=gen).to(grad_dtype("fp8")) * 1e-3 for s in shapes]
        host_state._step("fp8", params, grads, moments, steps, CFG, 3e-3, [True, False], None, one_pass)
        runs.append([*params, *(t for mom in moments for t in mom.tensors().values())])
    return runs


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_every_stored_fp8_byte_expands_as_torch_does():
    """All 256 float8_e4m3fn bit patterns (both zeros, subnormals, the largest, both NaNs, negative second
    moments, which the floor lifts) as stored first and second moments, in the vector body and the scalar
    tail: each element's weight shows its expansion."""
    assert host_kernel.available(), host_kernel.why_not()
    every = (torch.arange(FP8_BLOCK + 3) * 101 % 256).to(torch.uint8)  # 101 is odd: all 256 in the first block
    runs = _fp8_steps_from(every, [1e-4, 3e-5], [1e-9, 2e-9], seed=5)
    for i, (a, b) in enumerate(zip(*(run[:2] for run in runs))):
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)) and 0 < int(nan.sum()) < a.numel() // 2, i
        _assert_same_bits([a[~nan]], [b[~nan]], f"tensor {i}")


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_every_finite_fp8_byte_in_a_full_block_expands_as_torch_does():
    """The 254 finite codes (no NaN: the vector loop takes the block) as first and second moments of full
    blocks, with scales from tiny to near the 2^120 edge where the vector loop hands over to the element one."""
    assert host_kernel.available(), host_kernel.why_not()
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    every = codes[torch.arange(3 * FP8_BLOCK) * 101 % len(codes)]
    runs = _fp8_steps_from(every, [1e-4, 2.0**-126, 2.0**119], [1e-9, 2.0**119, 2.0**120], seed=6)
    for i, (a, b) in enumerate(zip(*runs)):
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float())), i
        _assert_same_bits([a[~nan]], [b[~nan]], f"tensor {i}")
    assert not torch.isnan(runs[0][0][:FP8_BLOCK]).any()  # the ordinary block stays finite: not vacuous


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_odd_fp8_state_gives_the_same_bits():
    """Stored fp8 state the vector loop must hand over or handle: negative and -0 scales (a corrupt checkpoint;
    a negative second moment's scale would break its sign-free codes), and a block whose first moment is so
    large that its quantiser is below 2^-118 (requantised at once) while its second moment's requantisation is
    deferred into the next block's loop alone."""
    assert host_kernel.available(), host_kernel.why_not()
    shapes = [(3 * FP8_BLOCK,), (3 * FP8_BLOCK + 5,)]
    runs = []
    for one_pass in (False, True):
        gen, params, moments, steps = _state("fp8", shapes, 9)
        ordinary = torch.randint(0x08, 0x70, (2, *shapes[1]), generator=gen, dtype=torch.uint8)
        for mom, n in zip(moments, (s[0] for s in shapes)):
            mom.exp_avg.view(torch.uint8).copy_(ordinary[0, :n] | (ordinary[1, :n] & 0x80))
            mom.exp_avg_sq.view(torch.uint8).copy_(ordinary[1, :n])
        moments[0].exp_avg.view(torch.uint8)[:FP8_BLOCK] = 0x7E  # 448 x 2^119 ~ 2.7e38 after the step
        moments[0].avg_scale.copy_(torch.tensor([2.0**119, 1e-4, 3e-4]))
        moments[0].sq_scale.copy_(torch.tensor([1e-9, 2e-9, 1e-9]))
        moments[1].avg_scale.copy_(torch.tensor([-1e-4, 1e-4, -0.0, 1e-4]))
        moments[1].sq_scale.copy_(torch.tensor([-1e-9, -0.0, 1e-9, -1e-9]))
        steps = [torch.ones(()) for _ in shapes]
        grads = [(torch.randn(s, generator=gen) * 1e-3).to(grad_dtype("fp8")) for s in shapes]
        host_state._step("fp8", params, grads, moments, steps, CFG, 3e-3, [True, False], None, one_pass)
        runs.append([*params, *(t for mom in moments for t in mom.tensors().values())])
    _assert_same_bits(runs[0], runs[1], "odd fp8 state")
    assert float(runs[0][2].view(torch.float8_e4m3fn)[:FP8_BLOCK].float().abs().max()) == 448.0  # not vacuous
    assert runs[0][4][0] > 2.0**118  # that block's quantiser, 1 / its scale, is below 2^-118: not vacuous


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_vector_fp8_conversions_agree_with_c10s_on_every_input():
    """host_kernel.c's AVX-512 conversions against its element functions (c10's rounding), exhaustively: all
    256 codes expanded, and every fp32 of [-448, 448] rounded to e4m3 (2.3e9 values, 10-35 s of one core by
    machine, shared between the cores), and the few past 448 that a block's largest value times its quantiser
    can give."""
    assert host_kernel.available(), host_kernel.why_not()
    bad = kernel_checks.fp8_check(1)
    if bad < 0:
        pytest.skip("this machine's build has no AVX-512 fp8 path")
    assert bad == 0


# Targets other hosts compile for (host_kernel.c's paths by what -march=native defines), with the CPU flags a
# build for them needs to run here: AVX2 only (no AVX-512 fp8 or bf16 loop: the element loops, as the compiler
# vectorises them), and AVX-512 without VBMI and AVX512_BF16 (the fp8 loop's byte packing by vpmovwb; the bf16
# loop, which needs AVX-512 F/BW/VL/DQ only).
OTHER_TARGETS = {"x86-64-v3": {"avx2", "fma", "f16c", "bmi2"},
                 "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}}


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("target", list(OTHER_TARGETS))
def test_a_build_for_another_cpu_gives_the_same_bits(target, fresh_kernel, monkeypatch):
    """The kernel as a host without this CPU's extensions builds it, built here for that target: it passes the
    load-time check, and every policy's steps (every size boundary, clip factors, gradients down to subnormal
    squares, NaN and inf blocks) equal the torch path's bits; its fp8 conversions agree with c10's."""
    flags = set(host_kernel._cpu().rsplit("|", 1)[-1].split())
    if not OTHER_TARGETS[target] <= flags:
        pytest.skip(f"this CPU cannot run a build for {target}")
    monkeypatch.setattr(host_kernel, "FLAGS", [f"-march={target}" if f == "-march=native" else f
                                               for f in host_kernel.FLAGS])
    assert host_kernel.available(), host_kernel.why_not()
    assert kernel_checks.bf16_check(97) == (0 if target == "skylake-avx512" else -1)
    assert kernel_checks.fp8_check(97) == (0 if target == "skylake-avx512" else -1)
    shapes = [(7,), (FP8_BLOCK - 1,), (FP8_BLOCK + 9,), (33, 31), (5 * FP8_BLOCK + 23,)]
    clips = [None, torch.tensor(0.31), None, torch.tensor(0.07)]
    for policy in POLICIES:
        for scale in (1.0, 1e-19):
            _assert_same_bits(_run(policy, shapes, clips, False, scale), _run(policy, shapes, clips, True, scale),
                              f"{policy} built for {target}, gradient scale {scale}")
        _assert_same_bits_but_nans(policy)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("stride", [13, pytest.param(1, marks=pytest.mark.slow)])
def test_the_vector_bf16_stochastic_rounding_agrees_with_the_element_loops(stride):
    """host_kernel.c's bf16 moments rounded 16 at a time (the hash in 16 lanes, both halves of the draw, the
    NaN select) against the element loop's SR: every 13th fp32 bit pattern (about 1 s), all 2^32 when slow."""
    assert host_kernel.available(), host_kernel.why_not()
    bad = kernel_checks.bf16_check(stride)
    if bad < 0:
        pytest.skip("this machine's build has no AVX-512 path")
    assert bad == 0


def test_fp8_blocks_are_multiplied_by_448_over_their_amax():
    """host_adamw._quantiser: 448 / amax rounded once, at most FLT_MAX (zero and tiny amaxes: the block's values
    times it stay within +-448), and for a non-finite block the reciprocal of the division it had (inf: 0, NaN:
    1). The kernel computes the same (the tests above compare the bits)."""
    gen = torch.Generator().manual_seed(0)
    amax = torch.rand(4000, generator=gen) * 10.0 ** torch.randint(-44, 38, (4000,), generator=gen).float()
    r = host_adamw._quantiser(amax)
    biggest = torch.finfo(torch.float32).max
    assert torch.equal(r, (448 / amax.double()).clamp(max=biggest).float())  # one rounding (double's is exact)
    assert (amax * r <= 448 * (1 + 2**-23)).all() and (r < biggest).sum() > 3000 and (r == biggest).sum() > 100
    special = host_adamw._quantiser(torch.tensor([0.0, float("inf"), float("nan")]))
    assert special.tolist()[:2] == [torch.finfo(torch.float32).max, 0.0] and special[2] == 1.0


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", ["exact", "bf16"])
def test_a_first_moment_weight_of_half_or_more_takes_torchs_other_lerp(policy):
    """beta1 < 0.5: torch computes the lerp as g - (g - m)(1 - w); so must the kernel."""
    cfg = TrainSpec(micro_batch=1, seq_len=1, weight_decay=0.1, betas=(0.2, 0.9))
    shapes = [(37,), (FP8_BLOCK + 5,)]
    clips = [None, torch.tensor(0.4), None]
    _assert_same_bits(_run(policy, shapes, clips, False, cfg=cfg), _run(policy, shapes, clips, True, cfg=cfg),
                      policy)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", ["exact", "fp8"])
def test_a_split_between_threads_gives_the_same_bits(policy, monkeypatch):
    """A tensor large enough to be split between host threads (pieces at BLOCK boundaries, one tail)."""
    assert host_kernel.available(), host_kernel.why_not()
    monkeypatch.setattr(host_kernel, "MIN_PIECE", 1024)
    shapes = [(3 * 1024 + 13,), (9 * FP8_BLOCK,)]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = _run(policy, shapes, [torch.tensor(0.5), None], one_pass=True)
    finally:
        torch.set_num_threads(threads)
    _assert_same_bits(_run(policy, shapes, [torch.tensor(0.5), None], one_pass=False), got, policy)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_check_catches_a_kernel_whose_bits_differ(fresh_kernel):
    """Where the scalar tail starts is the one thing measured rather than derived: with it wrong, the check
    must refuse the kernel (and the step then runs the torch path)."""
    assert host_kernel.available()
    right = host_kernel._state["lanes"]
    for wrong in (4, 16):
        host_kernel._state["lanes"] = wrong
        assert host_kernel.self_check().startswith("policy exact"), wrong
    host_kernel._state["lanes"] = right
    assert host_kernel.self_check() == ""


@pytest.mark.skipif(not CAPABLE, reason="torch not vectorised for AVX2/AVX-512: the capability is the reason")
def test_no_compiler_falls_back_to_torch_ops_with_the_reason(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("WARNING", logger="megatrain.runtime.host_kernel"):
        assert not host_kernel.available()
    assert "no C compiler" in host_kernel.why_not() and "kernel is off" in caplog.text
    assert not fresh_kernel.exists() or not list(fresh_kernel.iterdir())
    shapes = [(300,)]
    gen, params, moments, steps = _state("bf16", shapes, 0)
    before = params[0].clone()
    adamw_step("bf16", params, [torch.randn(300).bfloat16()], moments, steps, CFG, 1e-3)
    assert not torch.equal(before, params[0]) and float(steps[0]) == 1.0


def test_turned_off_by_the_environment(fresh_kernel, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_HOST_KERNEL", "0")
    assert not host_kernel.available() and host_kernel.why_not() == "MEGATRAIN_HOST_KERNEL=0"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_build_is_cached_and_leaves_no_partial_file(fresh_kernel):
    first = host_kernel._build()
    assert first.parent == fresh_kernel and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert host_kernel._build() == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in fresh_kernel.iterdir()) == [first.name, first.name + ".sha256"]


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("spoil", ["truncate", "garbage", "another-library", "no-digest"])
def test_a_spoiled_cached_library_is_built_again(fresh_kernel, spoil):
    """A cached library that is not the one built (loading a truncated one was SIGBUS; a garbage one turned
    the kernel off for good) is rebuilt before anything loads it."""
    lib = host_kernel._build()
    good = lib.read_bytes()
    if spoil == "truncate":
        lib.write_bytes(good[: len(good) // 3])
    elif spoil == "garbage":
        lib.write_bytes(os.urandom(100))
    elif spoil == "another-library":
        lib.write_bytes(good[:-64] + bytes(64))
    else:
        lib.with_name(lib.name + ".sha256").unlink()
    host_kernel._state.clear()
    assert host_kernel.available(), host_kernel.why_not()
    assert lib.read_bytes() == good and not list(fresh_kernel.glob("*.tmp"))


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_a_compiler_error_is_reported_not_raised(fresh_kernel, monkeypatch, tmp_path):
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(host_kernel, "SOURCE", bad)
    assert not host_kernel.available()
    assert "could not build or load broken.c" in host_kernel.why_not()
    assert not list(fresh_kernel.glob("*.tmp"))


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_a_wrong_first_guess_of_the_tail_is_corrected_by_the_check(fresh_kernel, monkeypatch):
    """Where the tail starts is measured per torch build: a wrong first guess is tried, refused by the check,
    and the next guess that passes is kept; when none passes the kernel is off and says so."""
    cap = torch.backends.cpu.get_cpu_capability()
    right = dict(host_kernel.LANES)[cap]
    wrong = 16 if right != 16 else 4
    monkeypatch.setitem(host_kernel.LANES, cap, wrong)
    assert host_kernel.available() and host_kernel._state["lanes"] == right
    host_kernel._state.clear()
    monkeypatch.setattr(host_kernel, "OTHER_LANES", (wrong,))
    assert not host_kernel.available()
    assert "bits differ" in host_kernel.why_not() and f"any of {wrong} lanes" in host_kernel.why_not()


# -- the compute-dtype cast (megatrain/runtime/cast_kernel.c): torch's .to(torch.bfloat16), bit for bit ------------------
def _torch_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_cast_gives_torchs_bits_on_special_and_random_values():
    """Zeros, infinities, NaNs of both signs and several payloads (torch writes every NaN as 0xFFFF, not c10's
    scalar 0x7FC0), subnormals (not flushed), halfway cases, the largest finite (rounds to inf), and 2^22
    random bit patterns; at every length around a vector and its tail, from unaligned destinations (the
    streaming stores start at a 64-byte boundary), and split between threads."""
    from megatrain.runtime import cast_kernel

    assert cast_kernel.available(), cast_kernel.why_not()
    special = host_kernel.special_values()
    assert torch.isnan(special).sum() == 8 and (special.view(torch.int32) & 0x7F800000 == 0).sum() > 8
    gen = torch.Generator().manual_seed(7)
    noise = torch.randint(-2**31, 2**31, (1 << 22,), dtype=torch.int64, generator=gen).to(torch.int32)
    for x in [special, noise.view(torch.float32)] + [torch.cat([torch.randn(k, generator=gen), special])
                                                      for k in range(0, 70)]:
        for skip in (0, 1, 7, 33):  # the destination starts `skip` elements past a 64-byte boundary
            out = torch.empty(x.numel() + skip, dtype=torch.bfloat16)[skip:]
            cast_kernel.cast(x, out)
            assert torch.equal(out.view(torch.int16), _torch_bits(x)), (x.numel(), skip)
    big = torch.randn(3 * cast_kernel.MIN_PIECE + 123, generator=gen)
    out = torch.empty(big.numel(), dtype=torch.bfloat16)
    cast_kernel.cast(big, out, threads=3)  # pieces on the cast's own pool threads
    assert torch.equal(out.view(torch.int16), _torch_bits(big))


@pytest.mark.slow
@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_cast_gives_torchs_bits_on_every_fp32():
    """All 2^32 fp32 bit patterns against torch's .to(torch.bfloat16) (about a minute on 2 cores)."""
    from megatrain.runtime import cast_kernel

    assert cast_kernel.available(), cast_kernel.why_not()
    n = 1 << 24
    out = torch.empty(n, dtype=torch.bfloat16)
    for start in range(-2**31, 2**31, n):
        x = torch.arange(start, start + n, dtype=torch.int32).view(torch.float32)
        cast_kernel.cast(x, out)
        assert torch.equal(out.view(torch.int16), _torch_bits(x)), hex(start & 0xFFFFFFFF)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
def test_the_vector_cast_agrees_with_its_element_function():
    """cast_kernel.c's AVX-512 loop against its scalar one on every 31st fp32 bit pattern (stride 1 in C is
    every one: `vector_check(1)`)."""
    from megatrain.runtime import cast_kernel

    assert cast_kernel.available(), cast_kernel.why_not()
    assert kernel_checks.vector_check(31) in (0, -1)


@pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and torch vectorised for AVX2/AVX-512")
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_step_writing_the_bf16_copy_gives_the_step_and_its_cast(policy):
    """The "copy" place's optimizer step (mt_adamw_copy: each COPY_BLOCK updated, then cast while in cache)
    updates the weights and moments as a step without the copy does, and the copy is the updated weights cast
    to bf16 by torch; through the kernel and through torch ops, one and several threads."""
    shapes = [(7,), (40000,), (3 * 32768 + 5,), (33, 31)]
    for one_pass in (True, False):
        gen, params, moments, steps = _state(policy, shapes, 5)
        ref = [p.clone() for p in params]
        ref_m = [new_moments(policy, s) for s in shapes]
        ref_steps = [torch.zeros(()) for _ in shapes]
        copies = [torch.full(s, float("nan"), dtype=torch.bfloat16) for s in shapes]
        for _ in range(2):
            grads = [torch.randn(s, generator=gen).to(grad_dtype(policy)) for s in shapes]
            host_state._step(policy, params, grads, moments, steps, CFG, 3e-3, None, None, one_pass, copies)
            host_state._step(policy, ref, grads, ref_m, ref_steps, CFG, 3e-3, None, None, one_pass)
        _assert_same_bits(params, ref, f"{policy}, one pass {one_pass}: weights")
        for c, p in zip(copies, params):
            assert torch.equal(c.view(torch.int16), _torch_bits(p)), f"{policy}, one pass {one_pass}: copy"


def test_the_cast_without_the_kernel_is_torchs_copy(fresh_kernel, monkeypatch):
    """MEGATRAIN_HOST_KERNEL=0 turns the C cast off too: `cast` is then torch's copy_, the same bits."""
    from megatrain.runtime import cast_kernel

    monkeypatch.setenv("MEGATRAIN_HOST_KERNEL", "0")
    assert not cast_kernel.available() and cast_kernel.why_not() == "MEGATRAIN_HOST_KERNEL=0"
    x = torch.cat([torch.randn(1000), host_kernel.special_values()])
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    cast_kernel.cast(x, out)
    assert torch.equal(out.view(torch.int16), _torch_bits(x))
