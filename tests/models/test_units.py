"""Unit templates bound to flat buffers compute exactly what build_eager computes; the chunked loss is exact."""

import pytest
import torch
import torch.nn.functional as F

from megatrain.ir.layout import pack, views
from megatrain.ir.trace import trace
from megatrain.models import (
    StepInputs,
    build_eager,
    init_weights,
    preset,
    rope_tables,
    run_unit,
    templates,
)
from megatrain.models.config import ModelConfig
from megatrain.models.loss import chunked_cross_entropy


def _streamed_loss(config, weights, tokens, targets, loss_chunk=7, dtype=torch.float32):
    """Run the model unit by unit from flat buffers, the way the runtime binds them."""
    ir = trace(config, tokens.shape[0], tokens.shape[1], dtype)
    tmpls = templates(config)
    cos, sin = rope_tables(config, tokens.shape[1], dtype)
    inputs = StepInputs(tokens=tokens, targets=targets, cos=cos, sin=sin, loss_chunk=loss_chunk)
    carry = ()
    flats = {}
    for u in ir.units:
        named = {p.name: weights[u.tied.get(p.name, f"{u.name}.{p.name}")] for p in u.params}
        flat = pack(named, u.params, u.flat_numel, dtype=dtype)
        flats[u.name] = flat
        bound = views(flat, u.params)
        assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in bound.values())
        carry = run_unit(tmpls[u.template], bound, carry, inputs)
    return carry[0], flats


@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": True}, {"qkv_bias": True, "qk_norm": True},
                                     {"n_kv_heads": 4}])
def test_bound_templates_equal_eager(variant):
    config = ModelConfig(**{**preset("tiny").model_dump(), **variant})
    eager = build_eager(config, seed=3)
    tokens = torch.randint(0, config.vocab_size, (2, 24))
    targets = torch.randint(0, config.vocab_size, (2, 24))
    targets[0, :5] = -100
    weights = {n: p.detach() for n, p in eager.named_parameters()}
    if config.tie_embeddings:
        assert "head.lm_head.weight" not in weights
    streamed, _ = _streamed_loss(config, weights, tokens, targets)
    expected = eager(tokens, targets)
    torch.testing.assert_close(streamed, expected, rtol=1e-6, atol=1e-5)


def test_eager_weights_come_from_init_weights():
    config = preset("tiny")
    eager = build_eager(config, seed=5)
    init = init_weights(config, seed=5)
    assert set(init) == {n for n, _ in eager.named_parameters()}
    for n, p in eager.named_parameters():
        assert torch.equal(p.detach(), init[n]), n
    assert not torch.equal(init_weights(config, seed=6)["embed.embed_tokens.weight"], init["embed.embed_tokens.weight"])


@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
def test_chunked_cross_entropy_matches_full(chunk):
    h = torch.randn(64, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (64,))
    t[::7] = -100
    got = chunked_cross_entropy(h, w, t, chunk)
    want = F.cross_entropy((h @ w.t()), t, reduction="sum", ignore_index=-100)
    torch.testing.assert_close(got, want)
    gh, gw = torch.autograd.grad(got * 0.3, (h, w))
    eh, ew = torch.autograd.grad(want * 0.3, (h, w))
    torch.testing.assert_close(gh, eh)
    torch.testing.assert_close(gw, ew)


def test_chunked_cross_entropy_gradcheck():
    h = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 5, -100, 2, 3, 1, 1, -100, 4])
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, t, 4), (h, w))


def test_chunked_loss_never_holds_full_logits():
    """The head's peak inside backward is far below the (tokens, vocab) logits it would otherwise hold."""
    config = ModelConfig(name="wide-vocab", vocab_size=32000, d_model=64, n_layers=1, n_heads=2, ffn_dim=128)
    ir = trace(config, 1, 2048, "float32", loss_chunk=128)
    head = ir.units[-1]
    full_logits = 2048 * 32000 * 4
    assert head.peak_bwd_bytes < full_logits / 3
    assert head.peak_fwd_bytes < full_logits / 5


# -- the block's kernels (issue 16 item 7): fused RMSNorm, RoPE with one copy, grouped-query attention ------
class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a region dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.args: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        self.args.append(args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs_fused_math_and_saves_only_its_input_and_row_statistics(dtype):
    from megatrain.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    norm = norm.to(dtype)
    x = torch.randn(2, 8, 64).to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    # torch's own rms_norm: fp32 statistics, weight applied in fp32, one rounding (fp32: the old formula too)
    assert torch.equal(y, F.rms_norm(x, (64,), norm.weight, 1e-5))
    if dtype == torch.float32:
        xf = x.detach()
        assert torch.equal(y, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight)
    # what autograd keeps: x itself, the weight and one fp32 number per row; no fp32 copy of x
    assert sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in (x.data_ptr(), norm.weight.data_ptr())) \
        == 2 * 8 * 4
    g = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), g)
    xr, wr = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    want = torch.autograd.grad(F.rms_norm(xr, (64,), wr, 1e-5), (xr, wr), g.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(dx.double(), want[0], **tol)
    torch.testing.assert_close(dw.double(), want[1], **tol)


def test_rms_norm_backward_passes_gradcheck():
    from megatrain.models.layers import _RMSNorm

    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-6), (x, w))


def test_rope_is_the_rotate_half_formula_in_three_kernels():
    from megatrain.models.layers import apply_rope

    c = preset("tiny")
    cos, sin = rope_tables(c, 24, torch.float32)
    x = torch.randn(2, c.n_heads, 24, c.head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos + torch.cat((-x2, x1), dim=-1) * sin  # Hugging Face LLaMA's apply_rotary_pos_emb
    with _Ops() as seen:
        got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    big = [op for op in seen.ops if op in ("flip", "mul", "addcmul", "cat", "neg", "add")]
    assert sorted(big) == ["addcmul", "cat", "flip", "mul", "neg"]  # cat and neg on the (T, hd) sine only


@pytest.mark.parametrize("device, target, dtype, repeats", [
    ("cpu", "cpu", torch.float32, False),  # the CPU flash kernel broadcasts K and V
    ("meta", "cuda", torch.bfloat16, False),  # CUDA's flash kernel in bf16 too
    ("meta", "cpu", torch.bfloat16, False),
    ("meta", "cuda", torch.float32, True),  # CUDA fp32 runs the memory-efficient kernel: no GQA there
])
def test_grouped_query_attention_repeats_k_and_v_only_where_the_kernel_cannot_broadcast(device, target, dtype,
                                                                                       repeats):
    from megatrain.models.layers import causal_attention

    q = torch.randn(1, 8, 32, 16, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 32, 16, device=device, dtype=dtype) for _ in range(2))
    with _Ops() as seen:
        y = causal_attention(q, k, v, target)
    (kernel_args,) = [a for op, a in zip(seen.ops, seen.args) if "attention" in op]
    assert kernel_args[1].shape[1] == (8 if repeats else 2)  # the heads of the K the fused kernel reads
    assert y.shape == q.shape
    if device == "cpu":
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_saves_k_and_v_at_their_own_heads():
    """The traced block keeps K and V at n_kv heads for backward, not repeated to n_heads."""
    base = preset("tiny").model_dump()
    mha = trace(ModelConfig(**{**base, "n_kv_heads": base["n_heads"]}), 2, 64, "bf16", target="cuda").units[1]
    gqa = trace(ModelConfig(**{**base, "n_kv_heads": 1}), 2, 64, "bf16", target="cuda").units[1]
    hd, kv_bytes = base["d_model"] // base["n_heads"], 2 * 2 * 64 * 2  # k and v, batch 2, seq 64, bf16
    assert mha.saved_bytes - gqa.saved_bytes >= (base["n_heads"] - 1) * hd * kv_bytes


@pytest.mark.parametrize("variant", [{}, {"depth_mixing": "depthssd:4"}, {"base": "moe-tiny"}, {"qkv_bias": True}])
@pytest.mark.parametrize("threads", [1, 3])
def test_init_into_draws_init_weights_bits_in_place(variant, threads):
    """The host store draws its masters in place, tensors in parallel: the same bits as init_weights."""
    from megatrain.models import init_into, init_weights

    variant = dict(variant)
    config = ModelConfig(**{**preset(variant.pop("base", "tiny")).model_dump(), **variant})
    ref = init_weights(config, 5)
    flat = torch.full((sum(t.numel() for t in ref.values()),), float("nan"))
    dests, at = {}, 0
    for name, t in ref.items():
        dests[name], at = flat[at : at + t.numel()], at + t.numel()
    init_into(config, 5, dests, threads=threads)
    for name, t in ref.items():
        assert torch.equal(dests[name].view(t.shape), t), name
    with pytest.raises(ValueError, match="contiguous fp32"):
        init_into(config, 5, {"embed.embed_tokens.weight": torch.empty(3, dtype=torch.bfloat16)})
