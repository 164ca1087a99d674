"""DepthSSD's chunked state read (models/depth/depthssd.py, `depthssd:N:chunk=2`, the default), DenseFormer's
weight decay, and the depth throughput benchmark (benchmarks/depth_throughput.py) at tiny sizes.

- The chunked read is the per-sub-layer recurrence reassociated: the two agree to fp32 round-off, each as
  close to an fp64 run as the other; rank 1 with unit coefficients is still the residual model's loss bit for
  bit (tests/models/test_depth_mixing.py); its write's backward is checked against finite differences.
- It moves fewer bytes per token and saves no mid-block state: the trace's saved bytes drop by N·T·d fp32 a
  block.
- DenseFormer's DWA weights take weight decay (the official code decays them); other mixings' do not.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, build_eager, decays, preset
from megatrain.models.depth import depthssd, parse_depth

ROOT = Path(__file__).resolve().parents[2]
BASE = {**preset("tiny").model_dump(), "n_layers": 3}


def _config(mixing: str) -> ModelConfig:
    return ModelConfig(**{**BASE, "depth_mixing": mixing})


def _loss_and_grads(mixing: str, dtype: torch.dtype, randomise: bool):
    model = build_eager(_config(mixing), seed=3, dtype=dtype)
    if randomise:  # decays well below 1 and generic B, C: every term of the reassociation matters
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".mix." in name:
                    p.copy_(torch.randn(p.shape, generator=g))
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 256, (2, 24), generator=g) for _ in range(2))
    loss = model(tokens, targets)
    names = [n for n, _ in model.named_parameters()]
    return loss, dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))


def test_spec_takes_the_chunk_and_defaults_to_the_block():
    assert parse_depth("depthssd:8") == parse_depth("depthssd:8:chunk=2")
    assert parse_depth("depthssd:8").chunk == 2 and str(parse_depth("depthssd:8:chunk=2")) == "depthssd:8"
    assert str(parse_depth("depthssd:4:chunk=1")) == "depthssd:4:chunk=1"
    assert _config("depthssd:4:chunk=1").depth_mixing == "depthssd:4:chunk=1"
    for bad, error in [("depthssd:8:chunk=3", "chunk must be one of"), ("depthssd:8:size=2", "malformed"),
                       ("hc:4:chunk=1", "malformed")]:
        with pytest.raises(ValueError, match=error):
            parse_depth(bad)


@pytest.mark.parametrize("randomise", [False, True])
def test_chunked_equals_per_sublayer_to_fp32_round_off(randomise):
    want, want_g = _loss_and_grads("depthssd:4:chunk=1", torch.float64, randomise)
    errs = {}
    for mixing in ("depthssd:4:chunk=1", "depthssd:4"):
        loss, grads = _loss_and_grads(mixing, torch.float32, randomise)
        assert abs(loss.double() - want) <= 1e-6 * want.abs()
        errs[mixing] = max(float((grads[n].double() - want_g[n]).abs().max() / want_g[n].abs().max()) for n in want_g)
    # fp64 is the truth: the chunked read's round-off is of the per-sub-layer one's size
    assert errs["depthssd:4"] <= 1e-3 and errs["depthssd:4"] <= 4 * errs["depthssd:4:chunk=1"], errs


def test_block_write_gradients():
    args = (torch.randn(3, 2, 5, 4, dtype=torch.float64, requires_grad=True),
            torch.tensor(0.6, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(depthssd.BlockWrite.apply, args)
    s, p, b, v1, v2 = (x.detach() for x in args)
    want = (s * p + b[0].view(-1, 1, 1, 1) * v1) + b[1].view(-1, 1, 1, 1) * v2
    torch.testing.assert_close(depthssd.BlockWrite.apply(s, p, b, v1, v2), want)  # addcmul_ may fuse (FMA)


def test_per_sublayer_rebuild_still_recovers_the_carry_in():
    from megatrain.models import StepInputs, rope_tables

    config = _config("depthssd:8:chunk=1")
    model = build_eager(config, seed=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".theta"):
                p.fill_(1.0)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(config, 24, torch.float32)
    inputs = StepInputs(tokens=tokens, cos=cos, sin=sin, target="cpu")
    with torch.no_grad():
        carry = model.embed((), inputs)
        out, side = model.blocks[0](carry, inputs, record=True)
        rebuilt = model.blocks[0](out, inputs, rebuild=side)
    torch.testing.assert_close(rebuilt[0], carry[0], rtol=1e-5, atol=1e-6)


def test_chunked_saves_no_mid_block_state():
    """The per-sub-layer form keeps the state between a block's two sub-layers for backward (N x T x d fp32);
    the chunked one reads the carry-in, which the runtime already holds, and keeps instead T x d fp32 tensors
    of its own: the two reads (the second one's decay needs it for its gradient) and v_1 in fp32."""
    n, b, t, d = 8, 1, 16, BASE["d_model"]
    per = trace(_config(f"depthssd:{n}:chunk=1"), b, t, "bf16", target="cpu").unit("blocks.1")
    chunked = trace(_config(f"depthssd:{n}"), b, t, "bf16", target="cpu").unit("blocks.1")
    assert per.saved_bytes - chunked.saved_bytes >= (n - 3) * b * t * d * 4
    assert chunked.carry_in_bytes == per.carry_in_bytes == n * b * t * d * 4


def test_chunked_moves_fewer_bytes_per_token():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import depth_throughput as dt

    config, batch, seq = dt.parse_shape("tiny:1x32")
    got = {}
    for spec in ("depthssd:8:chunk=1", "depthssd:8"):
        c = ModelConfig(**{**config.model_dump(), "depth_mixing": spec})
        got[spec] = dt.measure(c, batch, seq, "cpu", torch.float32, steps=1, warmup=0, count_bytes=True)["bytes_per_token"]
    # the passes over the state a block fall from 32 to 18 (docs/RESULTS.md); the chunked read's own T x d
    # work gives back a few state-sized passes' worth at N = 8
    state = 8 * config.d_model * 4 * config.n_layers
    assert got["depthssd:8:chunk=1"] - got["depthssd:8"] >= 9 * state, got


def test_denseformer_dwa_weights_decay_as_the_official_code_does():
    assert decays("blocks.3.mix.alpha", (4,))
    assert not decays("blocks.3.mix.attn.alpha", (4, 5))  # Hyper-Connections' width/depth connections
    assert not decays("blocks.0.mix.B", (3, 4)) and not decays("blocks.0.mix.theta", (2,))
    named = dict(build_eager(_config("denseformer")).named_parameters())
    assert [n for n in named if ".mix." in n and decays(n, tuple(named[n].shape))] == \
        [f"blocks.{i}.mix.alpha" for i in range(3)]


def test_host_store_decays_the_dwa_weights():
    """With zero gradients AdamW's update is the decay alone: DenseFormer's α shrinks by (1 - lr·wd) in the
    host store as in the eager optimizer's groups."""
    from megatrain.planner import TrainSpec
    from megatrain.runtime.store import HostStore

    spec = TrainSpec(micro_batch=1, seq_len=16, dtype="fp32", lr=0.1, weight_decay=0.5)
    store = HostStore(trace(_config("denseformer"), 1, 16, "fp32", target="cpu"), spec)
    before = {n: t.clone() for n, t in store.named_master().items()}
    for name in store.units:
        store.units[name].grad.zero_()
        store.step_unit(name, lr=0.1)
    after = store.named_master()
    for i in range(3):
        name = f"blocks.{i}.mix.alpha"
        torch.testing.assert_close(after[name], before[name] * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)


def test_the_throughput_benchmark_rehearses_every_variant(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import depth_throughput as dt

    out = tmp_path / "d.json"
    assert dt.main(["--rehearse", "--device", "cpu", "--shapes", "tiny:1x16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == dt.VARIANTS
    assert all(r["status"] == "measured" and r["tokens_per_s"] > 0 for r in result["rows"])
    assert result["status"].startswith("rehearsed: 7 of 7 runs")
    assert "DepthSSD-8 chunked/per sub-layer" in dt.status_line(result["rows"], "CPU", rehearse=False)
    assert dt.attnres_blocks(12) == 8 and dt.attnres_blocks(18) == 9  # 125m, 1b
    # the naive stack and the running sum are the same average
    xs = [torch.randn(2, 3, 4) for _ in range(3)]
    alpha = torch.randn(3)
    torch.testing.assert_close(dt.stacked_dwa(alpha, xs), dt.denseformer_dwa(alpha, xs))
    # a budget spent before the second run skips the rest, said as such
    ticks = iter(range(100))  # a clock at which every run takes 1 s, whatever the machine's load
    rows = dt.run(["tiny:1x16"], ["residual", "hc:4"], "cpu", torch.float32, 1, 0, budget_s=1.5, count_bytes=False,
                  log=lambda s: None, clock=lambda: float(next(ticks)))
    assert rows[0]["status"] == "measured" and rows[1]["status"].startswith("skipped")
