"""The instruction: each op states its mode in one field and takes only its own operands; one formatter prints it
and feeds codegen."""

import pytest

from megatrain.codegen.emit import statement
from megatrain.ir.program import Instr


def test_forward_and_backward_default_to_the_plain_mode():
    fwd = Instr(op="forward", stream="compute", unit="blocks.0", slot=0, mb=0)
    bwd = Instr(op="backward", stream="compute", unit="blocks.0", slot=0, grad_slot=0, mb=0)
    assert (fwd.mode, fwd.source, bwd.mode, bwd.source) == ("plain", None, None, "recompute")
    assert str(fwd) == "[compute] forward(unit=blocks.0, slot=0, mb=0)"
    assert fwd.replace(mode="replay").mode == "replay"


@pytest.mark.parametrize("fields, match", [
    (dict(op="forward", stream="compute", unit="u", slot=0, mb=0, source="saved"), "forward takes no source"),
    (dict(op="backward", stream="compute", unit="u", slot=0, grad_slot=0, mb=0, mode="keep"), "backward takes no mode"),
    (dict(op="load_params", stream="h2d", unit="u", slot=0, accumulate=True), "load_params takes no accumulate"),
    (dict(op="store_grads", stream="d2h", unit="u", grad_slot=0, norm=True), "store_grads takes no norm"),
    (dict(op="optimizer_step", stream="host", unit="u", shard=True), "optimizer_step takes no shard"),
    (dict(op="free", stream="compute", buffer="x", workspace_bytes=8), "free has no workspace"),
    (dict(op="forward", stream="compute", unit="u", slot=0, mb=0, mode="saved"), "mode"),
])
def test_fields_that_do_not_apply_are_rejected(fields, match):
    with pytest.raises(ValueError, match=match):
        Instr(**fields)


@pytest.mark.parametrize("ins, text, code", [
    (Instr(op="forward", stream="compute", unit="blocks.1", slot=1, mb=0, mode="replay"),
     "[compute] forward(unit=blocks.1, slot=1, mb=0, mode=replay)", "rt.forward(3, 'blocks.1', slot=1, mb=0, mode='replay')"),
    (Instr(op="backward", stream="compute", unit="head", slot=0, grad_slot=1, mb=1, source="saved", accumulate=True,
           norm=True),
     "[compute] backward(unit=head, slot=0, grad_slot=1, mb=1, source=saved, accumulate=True, norm=True)",
     "rt.backward(3, 'head', slot=0, grad_slot=1, mb=1, source='saved', accumulate=True, norm=True)"),
    (Instr(op="store_grads", stream="d2h", unit="embed", grad_slot=0, host_grad=0, shard=True),
     "[    d2h] store_grads(unit=embed, grad_slot=0, host_grad=0, shard=True)",
     "rt.store_grads(3, 'embed', grad_slot=0, host_grad=0, shard=True)"),
    (Instr(op="wait", stream="h2d", event="opt.embed"), "[    h2d] wait(event=opt.embed)", "rt.wait(3, 'h2d', 'opt.embed')"),
    (Instr(op="free", stream="compute", buffer="carry.head.0"), "[compute] free(buffer=carry.head.0)",
     "rt.free(3, 'carry.head.0')"),
])
def test_the_listing_and_the_generated_code_show_the_same_operands(ins, text, code):
    assert str(ins) == text
    assert statement(3, ins, cross_step=False) == code
