"""The `chunks` pass (megatrain/planner/chunking.py): tile only what needs it, pick the size by predicted time under the
budget, and name the smallest workable budget with tiling considered when nothing fits."""

import pytest

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import InfeasiblePlanError, TrainSpec, plan


def _ir(name, seq, **kw):
    config = ModelConfig(**{**preset(name).model_dump(), "max_seq_len": seq})
    return trace(config, 1, seq, "bf16", **kw)


def _pass(p, name):
    return next(r for r in p.passes if r.name == name)


def test_short_sequences_stay_untiled():
    p = plan(trace("tiny", 1, 128), "cpu", TrainSpec(micro_batch=1, seq_len=128), "64MiB")
    chunks = _pass(p, "chunks")
    assert p.ir.chunk_tokens is None and "priced no other chunk sizes" in chunks.decisions[0]


def test_llama3_8b_at_1m_tokens_tiles_on_an_h200_and_names_its_floor_on_80_gib():
    ir = _ir("llama3-8b", 2**20)
    train = TrainSpec(micro_batch=1, seq_len=2**20)
    p = plan(ir, "h200", train)
    assert p.feasible and p.ir.chunk_tokens in ir.chunk_choices and p.ir.chunk_tokens < 2**20
    assert p.summary()["chunk_tokens"] == p.ir.chunk_tokens and p.summary()["traced_seq_len"] == ir.traced_seq_len
    chosen = next(line for line in _pass(p, "chunks").decisions if line.startswith("chose"))
    assert f"{p.ir.chunk_tokens:,} tokens" in chosen
    # the plan's units carry the chosen size's figures
    block = p.ir.units[1]
    assert block.peak_bwd_bytes == next(o.peak_bwd_bytes for o in ir.units[1].chunk_options
                                        if o.chunk_tokens == p.ir.chunk_tokens)
    with pytest.raises(InfeasiblePlanError) as e:
        plan(ir, "h100-sxm", train, "80GiB")
    msg = str(e.value)
    assert "smallest workable budget with units tiled in chunks of" in msg and "backward workspace" in msg
    assert 80 * 2**30 < e.value.needed_bytes < 140 * 2**30  # untiled it needs 324 GiB


def test_infeasible_error_names_the_instruction_at_the_peak():
    """The dominant component is read at the peak instruction of the compute-stream timeline (a backward's
    workspace here), not at the same index of the full lowering (an earlier forward, before the fix)."""
    ir = _ir("llama2-7b", 2**18, chunk_options=False)
    with pytest.raises(InfeasiblePlanError) as e:
        plan(ir, "h100-sxm", TrainSpec(micro_batch=1, seq_len=2**18), "60GiB")
    assert "dominated by the backward workspace of blocks." in str(e.value)
    assert "tiled" not in str(e.value)
