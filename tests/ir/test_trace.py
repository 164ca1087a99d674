"""Tracing: parameter counts, FLOPs against an analytic count, carries, JSON round-trip, the schedule IR."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from megatrain.cli import main
from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Instr, Program
from megatrain.ir.trace import trace
from megatrain.models import preset


def analytic_forward_flops(c, batch, seq):
    """2 FLOPs per multiply-add. Attention counts full (non-causal) QK^T and AV, the PaLM MFU convention,
    which is also what FlopCounterMode's SDPA formula counts."""
    tokens = batch * seq
    d, hd = c.d_model, c.head_dim
    proj = d * c.n_heads * hd + 2 * d * c.kv_heads * hd + c.n_heads * hd * d
    mlp = 3 * d * c.ffn_dim
    attn = 2 * 2 * batch * c.n_heads * seq * seq * hd
    block = 2 * tokens * (proj + mlp) + attn
    head = 2 * tokens * d * c.vocab_size
    return c.n_layers * block + head


@pytest.mark.parametrize("seq", [512, 4096])
def test_forward_flops_match_analytic(seq):
    c = preset("llama3-8b")
    ir = trace(c, 1, seq, "bf16")
    traced = sum(u.flops_fwd for u in ir.units)
    expected = analytic_forward_flops(c, 1, seq)
    assert abs(traced - expected) / expected < 0.02
    # backward is about twice forward for matmul-dominated units
    assert 1.8 < sum(u.flops_bwd for u in ir.units) / traced < 2.6


@pytest.mark.parametrize("target, dtype", [("cuda", "bf16"), ("cpu", "fp32"), ("cpu", "bf16")])
def test_head_backward_counts_its_three_matmuls(target, dtype):
    """The head's backward recomputes each chunk's logits and multiplies twice (dh, dW): 3 x 2NVd FLOPs. The
    dW product accumulates in fp32 (`addmm(out=)` or, on a GPU in bf16, `addmm(out_dtype=float32, out=)`),
    which FlopCounterMode counts, unlike the `addmm_` it replaced (the planner under-priced the head)."""
    c = preset("tiny")
    ir = trace(c, 2, 64, dtype, target=target, loss_chunk=48)
    head = ir.units[-1]
    logits = 2 * 2 * 64 * c.vocab_size * c.d_model
    assert (head.flops_fwd, head.flops_bwd) == (logits, 3 * logits)


def test_the_older_torch_fallback_of_the_head_gradient_counts_the_same(monkeypatch):
    """Where addmm(out_dtype=float32) refuses an fp32 accumulator, dW is mm(out_dtype=float32) a vocabulary
    block at a time: the same FLOPs, a temporary no larger than the bf16 logit gradient."""
    from megatrain.models import loss

    want = trace(preset("tiny"), 2, 64, "bf16", target="cuda").units[-1]
    monkeypatch.setitem(loss._FP32_ACCUMULATOR, "meta", False)
    got = trace(preset("tiny"), 2, 64, "bf16", target="cuda").units[-1]
    assert got.flops_bwd == want.flops_bwd
    assert got.peak_bwd_bytes <= want.peak_bwd_bytes + 2 * 64 * preset("tiny").vocab_size * 2


def test_units_carries_and_params():
    c = preset("tiny")
    ir = trace(c, 2, 64, "fp32")
    assert [u.name for u in ir.units] == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert ir.params_total == c.n_params()
    for a, b in zip(ir.units, ir.units[1:]):
        assert [s.shape for s in a.carry_out] == [s.shape for s in b.carry_in]
    assert ir.units[1].carry_in_bytes == 2 * 64 * 128 * 4
    assert ir.units[0].carry_in == ()
    assert ir.units[1].saved_bytes > ir.units[1].carry_in_bytes
    assert ir.units[1].peak_bwd_bytes >= ir.units[1].saved_bytes
    assert all(u.flat_numel >= sum(p.numel for p in u.params) for u in ir.units)
    assert ir.graph().number_of_edges() == len(ir.units) - 1


def test_tied_embeddings_counted_once():
    c = preset("125m")
    ir = trace(c, 1, 128)
    assert ir.params_total == c.n_params()
    assert ir.units[-1].tied == {"lm_head.weight": "embed.embed_tokens.weight"}
    assert ("embed", "head", "tied") in ir.edges


def test_model_ir_round_trips_json():
    ir = trace("tiny", 1, 32)
    again = ModelIR.from_json(ir.to_json())
    assert again == ir
    assert "blocks.0-3 x4" in str(again)
    with pytest.raises(ValidationError):
        ir.replace(micro_batch="many")


def test_program_rejects_unknown_buffers_and_wrong_streams():
    buf = Buffer(name="slot0", kind="param_slot", nbytes=10, static=True)
    ok = Program(n_micro_batches=1, buffers=(buf,), instrs=(Instr(op="load_params", stream="h2d", unit="embed",
                                                                 slot=0, writes=("slot0",)),))
    assert Program.from_json(ok.to_json()) == ok
    with pytest.raises(ValidationError, match="unknown buffer"):
        Program(n_micro_batches=1, buffers=(buf,), instrs=(Instr(op="free", stream="compute", buffer="x"),))
    with pytest.raises(ValidationError, match="cannot run on stream"):
        Instr(op="forward", stream="h2d", unit="embed")
    with pytest.raises(ValidationError, match="needs an event"):
        Instr(op="wait", stream="compute")


@pytest.mark.parametrize("name, count", [
    ("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("qwen2.5-14b", 14_770_033_664),
    ("qwen2.5-32b", 32_763_876_352), ("qwen2.5-72b", 72_706_203_648), ("llama3-70b", 70_553_706_496)])
def test_inspect_json_params_total(capsys, name, count):
    assert main(["inspect", "--model", name, "--seq-len", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_total"] == count
    assert {"name", "params", "flops_fwd", "flops_bwd", "saved_bytes", "carry_out_bytes"} <= set(out["units"][0])


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "--model", "nope"], "valid presets"),
    (["inspect", "--model", "tiny", "--seq-len", "0"], "positive integer"),
    (["inspect", "--model", "tiny", "--seq-len", "99999"], "max_seq_len"),
    (["inspect", "--model", "tiny", "--dtype", "int8"], "bf16"),
    (["inspect"], "--model"),
])
def test_cli_errors_are_one_line_exit_2(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "megatrain", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and needle in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("chunk", [None, 16])
def test_traced_memory_equals_a_real_cpu_run(chunk):
    """The meta trace's saved bytes and transient peaks are what the same unit allocates on real CPU tensors
    (the CPU flash kernel's own scratch aside, which neither sees), untiled and tiled; the output, the incoming
    gradient and the carry's gradient are the program's buffers, not the unit's workspace."""
    import dataclasses

    import torch

    from megatrain.ir.scaled import LiveBytes
    from megatrain.ir.trace import _unit_inputs
    from megatrain.models import run_unit, templates

    c = preset("tiny")
    ir = trace(c, 2, 64, "fp32", target="cpu", chunk_tokens=chunk)
    tmpls = templates(c)
    for u in (ir.units[1], ir.units[-1]):
        tm = tmpls[u.template]
        inputs = _unit_inputs(u.kind, c, 2, 64, torch.float32, 1024, "cpu", chunk=chunk)
        inputs = dataclasses.replace(inputs, targets=torch.randint(0, 256, (2, 64)) if u.kind == "head" else None)
        params = {n: torch.randn(p.shape, requires_grad=True) for n, p in tm.named_parameters()}
        carry = tuple(torch.randn(s.shape, requires_grad=True) for s in u.carry_in)
        existing = [*params.values(), *carry, inputs.cos, inputs.sin, *([inputs.targets] if u.kind == "head" else [])]
        known = {t.untyped_storage()._cdata for t in existing}
        saved = {}

        def pack(t, known=known, saved=saved):
            if t.untyped_storage()._cdata not in known:
                saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.no_grad(), LiveBytes(None, existing) as fwd:
            out = run_unit(tm, params, carry, inputs)
            fwd.exclude(out)
        del out
        with LiveBytes(None, existing) as bwd:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = run_unit(tm, params, carry, inputs)
            grad_out = [torch.randn_like(o) for o in out]
            grads = torch.autograd.grad(out, [*params.values(), *carry], grad_out)
            bwd.exclude([*grad_out, *grads[len(params):]])
            del out, grads
        peak = {m: max(sum(n for _, n in s) for s in m.sums) for m in (fwd, bwd)}
        assert (u.saved_bytes, u.peak_fwd_bytes, u.peak_bwd_bytes) == (sum(saved.values()), peak[fwd], peak[bwd])


def test_tracing_leaves_torchs_flop_formulas_as_they_were():
    """Importing the tracer and tracing change nothing global: megatrain completes torch's FLOP formulas (the
    CPU's fused attention, grouped-query shapes, addmm's dtype overload) in a copy of its own."""
    code = ("from torch.utils.flop_counter import flop_registry as r; before = dict(r); "
            "from megatrain.ir.trace import trace; from megatrain.models import preset; "
            "ir = trace(preset('tiny'), 1, 16, 'fp32', target='cpu'); "
            "assert dict(r) == before, set(r.items()) ^ set(before.items()); "
            "assert ir.units[1].attn_flops_fwd > 0; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
