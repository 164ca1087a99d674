"""Mixture-of-experts layers and routing: configs, parameter counts, the ET mechanics, causality, aux loss.

The ET mechanics (the Expert Threshold paper, arXiv 2603.11535): the bias-corrected EMA of
the per-step mean cutoff, the capacity bounds (drop above k_max, pad below k_min, training only), the
expert-choice warmup switch, and the pure threshold test at inference, which is causal where expert choice
is not. Streamed-equals-eager for MoE models is in tests/runtime/test_moe_exactness.py.
"""

import json

import pytest
import torch

from megatrain.ir.trace import trace
from megatrain.models import (
    ConfigError,
    ModelConfig,
    StepInputs,
    build_eager,
    load_model_config,
    preset,
    rope_tables,
    routing,
    templates,
)
from megatrain.models.config import MoEConfig
from megatrain.models.eager import EagerModel
from megatrain.models.moe import MoEFFN, active_params

MOE_TINY = preset("moe-tiny")


def with_moe(config: ModelConfig = MOE_TINY, **moe) -> ModelConfig:
    return ModelConfig(**{**config.model_dump(), "moe": {**config.moe.model_dump(), **moe}})


def counts(sel: routing.Selection) -> list[int]:
    """The selection's row counts per expert, read from the device (tests only)."""
    return sel.counts_t.tolist()


# -- configs and sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("moe, field, fix", [
    ({"n_experts": 0}, "moe.n_experts", ">= 1"),
    ({"n_experts": 2, "top_k": 3}, "top_k=3 exceeds n_experts=2", "lower top_k or add experts"),
    ({"capacity_factor": -0.5}, "moe.capacity_factor", "must be >= 0"),
    ({"router": "topk"}, "moe.router", "pick one of them"),
    ({"gate": "relu"}, "moe.gate", "not one of sigmoid, softmax"),
    ({"expert_mlp": "gelu"}, "moe.expert_mlp", "not one of relu2, swiglu"),
    ({"balance": "aux"}, "balance='aux' applies to router 'tc' only", "set balance to 'none'"),
    ({"momentum": 1.0}, "moe.momentum", "[0, 1)"),
    ({"bogus": 1}, "moe.bogus", "valid fields: router, n_experts"),
])
def test_bad_moe_config_is_one_line_naming_field_and_fix(tmp_path, moe, field, fix):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"base": "tiny", "moe": moe}))
    with pytest.raises(ConfigError) as e:
        load_model_config(str(path))
    msg = str(e.value)
    assert "\n" not in msg and field in msg and fix in msg, msg


def test_dense_first_needs_a_second_layer():
    with pytest.raises(ValueError, match="moe.dense_first leaves no MoE block"):
        ModelConfig(**{**MOE_TINY.model_dump(), "n_layers": 1})


def test_n_params_equals_the_traced_count():
    config = with_moe(router="tc", balance="bias", top_k=2, expert_dim=96, expert_mlp="swiglu", shared_expert=False,
                      dense_first=False)
    assert trace(config, 2, 32, "fp32", target="cpu").params_total == config.n_params()  # and moe-tiny below


@pytest.mark.parametrize("name, total, active", [("et-d12", 565_602_048, 176_318_208),
                                                 ("et-d20", 2_429_374_720, 561_598_720)])
def test_paper_presets(name, total, active):
    config = preset(name)
    with torch.device("meta"):
        counted = sum(p.numel() for p in EagerModel(config).parameters())
    assert config.n_params() == counted == total
    assert active_params(config) == active  # the paper: 575M / 195M (d12), 2.43B / 561M (d20)


def test_the_planner_plans_et_d20_like_a_dense_model():
    from megatrain.planner import TrainSpec, hardware_preset, plan

    ir = trace("et-d20", 1, 1024, "bf16")
    assert ir.params_total == preset("et-d20").n_params()
    p = plan(ir, hardware_preset("h200"), TrainSpec(micro_batch=1, seq_len=1024, grad_accum=4), 24 * 2**30)
    moe_unit = ir.unit("blocks.1")
    assert p.slot_bytes >= moe_unit.slot_bytes("bfloat16") > moe_unit.param_bytes("bfloat16")  # + its buffers
    assert p.peak_gpu_bytes <= 24 * 2**30 and p.tokens_per_s > 0


def test_templates_dense_first_block_and_buffers():
    tmpls = templates(MOE_TINY)
    assert set(tmpls) == {"embed", "block.dense", "block", "head"}
    assert isinstance(tmpls["block"].mlp, MoEFFN) and not isinstance(tmpls["block.dense"].mlp, MoEFFN)
    assert {n: tuple(b.shape) for n, b in tmpls["block"].named_buffers()} == {"mlp.threshold": (8,), "mlp.updates": ()}
    eager = build_eager(MOE_TINY, dtype=torch.bfloat16)
    assert all(b.dtype == torch.float32 and not b.any() for b in eager.buffers())  # fp32 zeros whatever the dtype


def test_trace_counts_expected_active_tokens_and_bounds_memory_at_capacity():
    n, d, w, e = 2 * 64, 128, 128, 8
    ir = trace(MOE_TINY, 2, 64, "fp32", target="cpu")
    assert ir.params_total == MOE_TINY.n_params()
    dense, moe = ir.unit("blocks.0"), ir.unit("blocks.1")
    k = routing.expected_rows(n, 1, e)  # 16 tokens per expert
    attn = dense.flops_fwd - 2 * n * 3 * d * MOE_TINY.ffn_dim
    assert moe.flops_fwd == attn + 2 * n * d * e + 2 * n * 2 * d * w + 2 * e * k * 2 * d * w
    assert [b.name for b in moe.buffers] == ["mlp.threshold", "mlp.updates"]
    ec = trace(with_moe(router="ec"), 2, 64, "fp32", target="cpu").unit("blocks.1")
    assert ec.flops_fwd == moe.flops_fwd and ec.saved_bytes < moe.saved_bytes  # ET memory at k_max = 1.5 k


# -- ET mechanics ---------------------------------------------------------------------------------------------
def test_bias_corrected_ema_of_the_mean_cutoff():
    moe = MoEConfig(momentum=0.9)
    bufs = {"threshold": torch.zeros(3), "updates": torch.zeros(())}
    a, b = torch.tensor([1.0, 2.0, -3.0]), torch.tensor([3.0, 0.0, -1.0])
    assert torch.equal(routing.corrected_threshold(bufs["threshold"], bufs["updates"], 0.9), torch.zeros(3))
    routing.update_layer(moe, bufs, [{"cutoff": a}, {"cutoff": b}])  # one step, two micro-batches: their mean
    assert float(bufs["updates"]) == 1
    torch.testing.assert_close(bufs["threshold"], 0.1 * (a + b) / 2)
    torch.testing.assert_close(routing.corrected_threshold(bufs["threshold"], bufs["updates"], 0.9), (a + b) / 2)
    c = torch.tensor([5.0, 5.0, 5.0])
    for n in range(2, 6):
        routing.update_layer(moe, bufs, [{"cutoff": c}])
        raw = 0.9**n * 0.1 * (a + b) / 2 / 0.9 + (1 - 0.9 ** (n - 1)) * c
        torch.testing.assert_close(bufs["threshold"], raw)
        torch.testing.assert_close(routing.corrected_threshold(bufs["threshold"], bufs["updates"], 0.9),
                                   raw / (1 - 0.9**n))
    assert float(bufs["updates"]) == 5


def test_capacity_bounds_drop_above_and_pad_below():
    assert routing.capacity(4, 0.5, 16) == (2, 6)
    assert routing.capacity(5, 0.5, 16) == (2, 7)
    assert routing.capacity(8, 0.5, 10) == (4, 10)
    assert routing.capacity(8, 0.0, 100) == (8, 8) and routing.capacity(8, 2.0, 100) == (0, 24)
    scores = torch.linspace(-1.5, 1.5, 16)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    logits = torch.stack([scores[perm] + 1.0, scores - 1.4, scores[perm.flip(0)]], dim=1)  # 16 tokens, 3 experts
    above = (logits >= 0).sum(0).tolist()
    assert above == [13, 1, 8]
    sel = routing.threshold_with_capacity(logits, torch.zeros(3), 4, 2, 6)
    assert counts(sel) == [6, 2, 6]  # 13 above -> the top 6 kept; 1 above -> padded to 2; 8 above -> capped at 6
    assert sel.token_idx.shape == (3 * 6,) and sel.rows.tolist() == [True] * 14 + [False] * 4  # E x k_max rows
    pairs, experts = sel.token_idx[sel.rows], sel.expert_idx[sel.rows]
    for e, count in enumerate(counts(sel)):
        assert torch.equal(pairs[experts == e], logits[:, e].topk(count).indices), e  # the highest-scoring tokens
    assert float(sel.stats["dropped"]) == (13 - 6) + (8 - 6) and float(sel.stats["padded"]) == 2 - 1
    within = routing.threshold_with_capacity(logits, torch.zeros(3), 8, 0, 16)
    assert counts(within) == above  # inside the bounds: exactly the tokens above the threshold


def test_warmup_switch_and_the_inference_rule():
    moe = MoEConfig(n_experts=4, warmup_steps=3, capacity_factor=0.5)
    logits = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    high = {"threshold": torch.full((4,), 9.0), "updates": torch.tensor(2.0)}  # no token reaches it
    k = routing.expected_rows(32, 1, 4)
    sel = routing.select(moe, logits, high, training=True)
    assert counts(sel) == [k] * 4  # step 2 < 3 warmup steps: expert choice, thresholds ignored
    assert torch.equal(sel.stats["cutoff"], logits.topk(k, dim=0).values[k - 1])  # the EMA still learns
    assert counts(routing.select(moe, logits, {**high, "updates": torch.tensor(3.0)}, training=True)) == [k // 2] * 4
    assert routing.select(moe, logits, high, training=False).counts == [0] * 4  # inference: r >= c_eff only
    low = {"threshold": torch.full((4,), -9.0), "updates": torch.tensor(3.0)}
    assert counts(routing.select(moe, logits, low, training=True)) == [int(1.5 * k)] * 4
    assert routing.select(moe, logits, low, training=False).counts == [32] * 4  # no capacity at inference


def test_expert_choice_learns_its_own_ema_cutoff_and_evaluates_by_it():
    moe = MoEConfig(router="ec", n_experts=4, momentum=0.5, warmup_steps=0)
    assert [name for name, _ in routing.buffer_shapes(moe, 4)] == ["threshold", "updates"]
    logits = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    k = routing.expected_rows(32, 1, 4)
    bufs = {"threshold": torch.zeros(4), "updates": torch.zeros(())}
    first = routing.select(moe, logits, bufs, training=True)
    assert first.counts == [k] * 4 and float(first.stats["lagged"]) == 0  # top-k in training; no EMA yet
    assert "moe_threshold_lag" not in routing.summarize({"b": [[routing.record_stats(first, 32, 4)]]}, top_k=1)
    routing.update_layer(moe, bufs, [routing.record_stats(first, 32, 4)])
    c_eff = routing.corrected_threshold(bufs["threshold"], bufs["updates"], 0.5)
    torch.testing.assert_close(c_eff, logits.topk(k, dim=0).values[k - 1])  # one update: the cutoff itself
    shifted = logits + torch.tensor([0.0, 1.0, -1.0, 0.0])
    train = routing.select(moe, shifted, bufs, training=True)
    assert train.counts == [k] * 4  # training stays expert choice whatever the threshold says
    torch.testing.assert_close(train.stats["lag"], torch.tensor([0.0, -1.0, 1.0, 0.0]))  # c_eff - k-th logit
    evaled = routing.select(moe, shifted, bufs, training=False)
    assert evaled.counts == (shifted >= c_eff).sum(0).tolist() and evaled.counts != [k] * 4  # r >= c_eff
    topk = routing.select(moe.model_copy(update={"ec_eval": "topk"}), shifted, bufs, training=False)
    assert topk.counts == [k] * 4


def test_threshold_lag_is_logged_per_step():
    moe = MoEConfig(n_experts=4, momentum=0.9, warmup_steps=1)
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(5))
    bufs = {"threshold": torch.full((4,), 0.1), "updates": torch.ones(())}  # c_eff = 0.1 / 0.1 = 1
    sel = routing.select(moe, logits, bufs, training=True)
    k = routing.expected_rows(64, 1, 4)
    lag = 1.0 - logits.topk(k, dim=0).values[k - 1]
    torch.testing.assert_close(sel.stats["lag"], lag)
    rec = routing.record_stats(sel, 64, 4)
    out = routing.summarize({"blocks.1": [[rec], [rec]]}, top_k=1)
    assert out["moe_threshold_lag"] == pytest.approx(float(lag.mean()))
    assert out["moe_threshold_lag_abs"] == pytest.approx(float(lag.abs().mean()))
    assert out["moe_threshold_rate"] == pytest.approx(float((logits >= 1.0).sum()) / 64)  # r >= c_eff, per N x top_k
    tc = routing.select(MoEConfig(router="tc"), logits, {}, training=True)
    assert "moe_threshold_lag" not in routing.summarize({"b": [[routing.record_stats(tc, 64, 4)]]}, top_k=1)


@pytest.mark.parametrize("rate, balanced", [(1e-3, False), (2e-2, True)])
def test_bias_balancing_balances_within_the_steps_its_rate_allows(rate, balanced):
    """b_i moves by at most u a step: an expert preferred by a logit margin of about 1 is balanced in about
    1/u steps, so u = 2e-2 balances within 100 steps and the DeepSeek-V3 u = 1e-3 does not."""
    moe = MoEConfig(router="tc", balance="bias", bias_rate=rate, n_experts=4)
    g = torch.Generator().manual_seed(0)
    skew = torch.tensor([1.0, 0.0, 0.0, -1.0])
    bufs = {"bias": torch.zeros(4)}
    for _ in range(100):
        logits = torch.randn(256, 4, generator=g) * 0.5 + skew
        sel = routing.select(moe, logits, bufs, training=True)
        routing.update_layer(moe, bufs, [routing.record_stats(sel, 256, 4)])
    load = sel.counts_t.float()
    assert (float(load.max() / load.mean()) < 1.3) is balanced, counts(sel)


# -- causality at inference -----------------------------------------------------------------------------------
def _routing_and_hidden(model, tokens, monkeypatch):
    """Per MoE layer the (tokens, experts) assignment mask, and the final hidden states, in eval mode."""
    masks = []
    select = routing.select

    def spy(moe, logits, buffers, training):
        sel = select(moe, logits, buffers, training)
        mask = torch.zeros(logits.shape, dtype=torch.bool)
        mask[sel.token_idx, sel.expert_idx] = True
        masks.append(mask.view(*tokens.shape, -1))
        return sel

    monkeypatch.setattr(routing, "select", spy)
    cos, sin = rope_tables(model.config, tokens.shape[1], torch.float32)
    inputs = StepInputs(tokens=tokens, cos=cos, sin=sin)
    with torch.no_grad():
        carry = model.embed((), inputs)
        for block in model.blocks:
            carry = block(carry, inputs)
        hidden = model.head.final(carry)
    monkeypatch.setattr(routing, "select", select)
    return masks, hidden


@pytest.mark.parametrize("router, ec_eval", [("et", "threshold"), ("ec", "threshold"), ("ec", "topk")])
def test_inference_routing_is_causal_for_thresholds_not_for_expert_choice_top_k(router, ec_eval, monkeypatch):
    config = with_moe(router=router, ec_eval=ec_eval)
    model = build_eager(config, seed=1).eval()
    for name, buf in model.named_buffers():  # ET state after 3 updates, c_eff = 1 (about 1/8 of logits above)
        buf.fill_(3.0 if name.endswith("updates") else 1 - config.moe.momentum**3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 48), generator=g)
    t = 23
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, 256, (2, 48 - t - 1), generator=g)
    masks_a, hidden_a = _routing_and_hidden(model, tokens, monkeypatch)
    masks_b, hidden_b = _routing_and_hidden(model, changed, monkeypatch)
    same_routing = all(torch.equal(a[:, : t + 1], b[:, : t + 1]) for a, b in zip(masks_a, masks_b))
    # NOTE: outputs agree to fp32 round-off, not bit for bit: an expert's GEMM blocks by how many tokens it takes
    drift = float((hidden_a[:, : t + 1] - hidden_b[:, : t + 1]).abs().max())
    if ec_eval == "threshold":  # et, and ec evaluated from its own EMA cutoff (the paper's causal evaluation)
        assert same_routing and drift < 1e-6
        assert 0 < sum(int(m.sum()) for m in masks_a) < sum(m.numel() for m in masks_a)  # routing is not trivial
    else:  # expert choice ranks the whole micro-batch: later tokens move earlier tokens in and out of experts
        assert not same_routing and drift > 1e-3


# -- aux loss -----------------------------------------------------------------------------------------------
def test_aux_loss_enters_the_gradient_scaled_like_the_loss():
    config = with_moe(router="tc", balance="aux", aux_loss_coef=0.5, gate="softmax", top_k=2)
    layer = build_eager(config, seed=2).blocks[1].mlp
    x = torch.randn(2, 16, config.d_model, generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 16, config.d_model, generator=torch.Generator().manual_seed(4))
    scale = 1 / 29

    def router_grad(context: bool) -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad()
        log = routing.RoutingLog()
        if context:
            with routing.step_context(log, scale):
                out = layer(x)
        else:
            out = layer(x)
        ((out * w).sum() * scale).backward()
        return layer.router.weight.grad.clone(), out.detach()

    plain, out_plain = router_grad(False)
    with_aux, out_aux = router_grad(True)
    assert torch.equal(out_plain, out_aux)  # forward values untouched
    logits = x.reshape(-1, config.d_model) @ layer.router.weight.T
    chosen = logits.topk(2, dim=1).indices
    f = torch.zeros(8).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel())) / (32 * 2)
    aux = 0.5 * 8 * (f * torch.softmax(logits, -1).mean(0)).sum()
    (expected,) = torch.autograd.grad(aux * 32 * scale, layer.router.weight)
    torch.testing.assert_close(with_aux - plain, expected)


# -- host syncs (issue 16 item 6) -------------------------------------------------------------------------------
class _Syncs(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that make a CUDA stream wait for the host (or the host for it): a scalar read, nonzero, bincount,
    unique, masked_select, mask indexing, repeat_interleave with tensor repeats and no output size."""

    READS = {"_local_scalar_dense", "nonzero", "bincount", "unique", "_unique", "_unique2", "unique_dim",
             "masked_select", "argwhere"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in self.READS:
            self.found.append(func.__name__)
        if name == "repeat_interleave" and func.__name__ != "repeat_interleave.self_int" \
                and kwargs.get("output_size") is None:
            self.found.append(func.__name__)
        if name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.found.append(func.__name__ + "(mask)")
        return func(*args, **kwargs)


def _layer(router: str, **moe) -> MoEFFN:
    layer = build_eager(with_moe(router=router, **moe), seed=2).blocks[1].mlp
    if router == "et":  # thresholds route (after warmup): drops and pads, an uneven E x k_max layout
        layer.updates.fill_(7.0)
        layer.threshold.fill_(0.1 * (1 - layer.moe.momentum**7))
    return layer


ROUTED = [("et", {"warmup_steps": 0}), ("et", {"warmup_steps": 100}), ("tc", {"top_k": 2}),
          ("tc", {"balance": "aux", "gate": "softmax"}), ("ec", {}),
          ("et", {"warmup_steps": 0, "expert_mlp": "swiglu"})]


def _counting_reads(monkeypatch) -> list[int]:
    counted: list[int] = []
    read = routing.read_counts
    monkeypatch.setattr(routing, "read_counts", lambda t: counted.append(1) or read(t))
    return counted


@pytest.mark.parametrize("router, moe", ROUTED)
def test_a_routed_training_step_reads_nothing_from_the_device(router, moe, monkeypatch):
    """A routed layer's training forward, its backward and its recompute sync nowhere: every training selection
    has static shapes and the experts run on device offsets (torch._grouped_mm); the recompute checks its row
    counts against its forward's on the device."""
    layer = _layer(router, **moe)
    x = torch.randn(2, 24, layer.router.in_features, generator=torch.Generator().manual_seed(5), requires_grad=True)
    counted = _counting_reads(monkeypatch)
    log = routing.RoutingLog()
    with routing.step_context(log, 1 / 48), _Syncs() as syncs:
        first = layer(x)
        first.square().sum().backward()
    assert (counted, syncs.found) == ([], [])
    assert len(log.counts) == len(log.records) == 1
    with routing.step_context(None, 1 / 48, replay=log.counts), _Syncs() as syncs:
        again = layer(x)
    assert (counted, syncs.found) == ([], [])
    assert torch.equal(first, again)


@pytest.mark.parametrize("router, moe", ROUTED)
def test_grouped_experts_equal_the_per_expert_loop_bit_for_bit(router, moe, monkeypatch):
    """The grouped matmuls give the bits of the loop over the experts, each on exactly its own rows (the
    fallback, and what the layer ran before it read nothing back), forward and gradients, padding included:
    a padding row adds an exact 0 to its token's output and gradient."""
    from megatrain.models import moe as moe_module

    def run() -> list[torch.Tensor]:
        layer = _layer(router, **moe)
        x = torch.randn(2, 24, layer.router.in_features, generator=torch.Generator().manual_seed(5),
                        requires_grad=True)
        w = torch.randn(2, 24, layer.router.in_features, generator=torch.Generator().manual_seed(6))
        with routing.step_context(routing.RoutingLog(), 1 / 48):
            out = layer(x)
        (out * w).sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]

    grouped = run()
    counted = _counting_reads(monkeypatch)
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: False)
    looped = run()
    assert len(counted) == (0 if router == "ec" else 1)  # the fallback's one named read (expert choice: static)
    assert all(torch.equal(a, b) for a, b in zip(grouped, looped))


class _GarbageTail(torch.autograd.Function):
    """torch._grouped_mm, with the rows past the last offset (in no group: unwritten, on a GPU whatever the
    memory held) set to NaN in its output and in its input's gradient."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        out = _GROUPED_MM(a, b, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
            ga, gb = torch.autograd.grad(_GROUPED_MM(a_, b_, offs=offs), (a_, b_), grad)
        ga[int(offs[-1]):] = float("nan")
        return ga, gb, None


_GROUPED_MM = getattr(torch, "_grouped_mm", None)


@pytest.mark.skipif(_GROUPED_MM is None, reason="torch._grouped_mm needs torch >= 2.8")
def test_padding_rows_never_leak_what_the_grouped_matmul_left_in_them(monkeypatch):
    """ET's padding rows are in no group of the grouped matmuls: whatever those leave in them (NaN here) is
    selected away, never multiplied, so outputs and gradients keep their bits."""
    def run() -> list[torch.Tensor]:
        layer = _layer("et", warmup_steps=0)
        x = torch.randn(2, 24, layer.router.in_features, generator=torch.Generator().manual_seed(5),
                        requires_grad=True)
        with routing.step_context(routing.RoutingLog(), 1 / 48):
            out = layer(x)
        out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]

    want = run()
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: _GarbageTail.apply(a, b, offs))
    got = run()
    assert all(torch.isfinite(g).all() and torch.equal(g, w) for g, w in zip(got, want))


def test_a_recompute_that_routes_otherwise_than_its_forward_is_caught():
    layer = build_eager(with_moe(router="tc"), seed=2).blocks[1].mlp
    x = torch.randn(2, 24, layer.router.in_features, generator=torch.Generator().manual_seed(5))
    log = routing.RoutingLog()
    with routing.step_context(log, 1 / 48):
        layer(x)
    shift = torch.zeros_like(log.counts[0])
    shift[:2] = torch.tensor([1, -1])
    with routing.step_context(None, 1 / 48, replay=[log.counts[0] + shift]), pytest.raises(RuntimeError):
        layer(x)
    with routing.step_context(None, 1 / 48, replay=[]), pytest.raises(RuntimeError, match="forward recorded 0"):
        layer(x)
