"""Codegen: render a Program as a straight-line Python step program, and load it back.

Where it sits: planner -> Plan -> `emit(plan)` -> source -> `load(source).step(rt, batch, lr)` on the engine
(runtime/engine.py). Try it: `megatrain compile --model tiny --hardware cpu --gpu-mem 4MiB --seq-len 64
--micro-batch 2 -o step.py`.

Safety: every identifier placed in the source is checked against a strict pattern and written with repr();
nothing from a user string is pasted in raw. The op set is closed (ir/program.py), so the method called is
always one of the engine's.
"""

from __future__ import annotations

import re
import types
from typing import Any

import jinja2

from megatrain import __version__
from megatrain.ir.display import format_bytes
from megatrain.ir.program import Instr, OpName, Program

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:#\-]{0,127}$")
_OPS = set(OpName.__args__)  # type: ignore[attr-defined]

_env = jinja2.Environment(loader=jinja2.PackageLoader("megatrain.codegen", "templates"), trim_blocks=True,
                          lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
                          undefined=jinja2.StrictUndefined)


class CodegenError(ValueError):
    """A program that cannot be rendered safely."""


def _ident(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise CodegenError(f"refusing to emit {what} {value!r}: names must match {_NAME.pattern}")
    return repr(value)


def _int(value: Any, what: str) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CodegenError(f"refusing to emit {what} {value!r}: expected an int")
    return str(value)


def statement(i: int, ins: Instr, cross_step: bool) -> str:
    """The one line of Python for instruction `i`."""
    if ins.op not in _OPS:
        raise CodegenError(f"unknown op {ins.op!r}")
    args = [str(i)]
    if ins.op in ("record", "wait"):
        args += [_ident(ins.stream, "stream"), _ident(ins.event, "event")]
        if ins.op == "wait" and cross_step:
            args.append("previous_step=True")
    elif ins.op in ("alloc", "free", "offload_act", "load_act"):
        args.append(_ident(ins.buffer, "buffer"))
    elif ins.op == "clip_grads":
        pass
    else:
        args.append(_ident(ins.unit, "unit"))
        if ins.op in ("load_params", "forward", "backward", "all_gather"):
            args.append(f"slot={_int(ins.slot, 'slot')}")
        if ins.op in ("backward", "store_grads", "reduce_scatter", "all_reduce"):
            args.append(f"grad_slot={_int(ins.grad_slot, 'grad_slot')}")
        if ins.op in ("forward", "backward"):
            args.append(f"mb={_int(ins.mb, 'mb')}")
        if ins.keep_graph:
            args.append("keep_graph=True")
        if ins.accumulate:
            args.append("accumulate=True")
        if ins.rebuild:
            args.append("rebuild=True")
        if ins.norm:
            args.append("norm=True")
        if ins.shard:
            args.append("shard=True")
        if ins.op in ("store_grads", "optimizer_step") and ins.host_grad is not None:
            args.append(f"host_grad={_int(ins.host_grad, 'host_grad')}")
    return f"rt.{ins.op}({', '.join(args)})"


def cross_step_waits(program: Program) -> set[int]:
    """Indices of waits whose record comes later in the program: they wait for the previous step's."""
    first_record: dict[str, int] = {}
    for i, ins in enumerate(program.instrs):
        if ins.op == "record":
            first_record.setdefault(ins.event, i)
    out = set()
    for i, ins in enumerate(program.instrs):
        if ins.op == "wait":
            if ins.event not in first_record:
                raise CodegenError(f"instruction {i} waits for event {ins.event!r} that is never recorded")
            if first_record[ins.event] > i:
                out.add(i)
    return out


def live_bytes(program: Program) -> list[int]:
    """Device buffer bytes live after each instruction (compute-stream allocation, see ir/README.md)."""
    sizes = {b.name: b.nbytes for b in program.buffers}
    live = sum(b.nbytes for b in program.buffers if b.static)
    alive: set[str] = set()
    out = []
    for ins in program.instrs:
        if ins.stream == "compute":
            for name in (*((ins.buffer,) if ins.op == "alloc" else ()), *ins.writes):
                if name in sizes and name not in alive and not program.buffer(name).static:
                    alive.add(name)
                    live += sizes[name]
            if ins.op == "free" and ins.buffer in alive:
                alive.discard(ins.buffer)
                live -= sizes[ins.buffer]
        out.append(live)
    return out


def emit(plan_or_program, title: str | None = None, summary: list[str] | None = None,
         passes: list[str] | None = None) -> str:
    """Python source of the step program. Accepts a Plan (with .program) or a bare Program."""
    program: Program = getattr(plan_or_program, "program", plan_or_program)
    if not isinstance(program, Program):
        raise ValueError(f"emit takes a Plan (megatrain.plan(...)) or its Program, got "
                         f"{type(plan_or_program).__name__}")
    if title is None:
        title = _plan_title(plan_or_program)
    if summary is None:
        summary = _plan_summary(plan_or_program)
    if passes is None:
        passes = [f"{p.name}: {p.seconds * 1e3:.1f} ms" for p in getattr(plan_or_program, "passes", ())]
    cross = cross_step_waits(program)
    live = live_bytes(program)
    codes = [statement(i, ins, i in cross) for i, ins in enumerate(program.instrs)]
    width = max((len(c) for c in codes), default=0)
    statements = [dict(code=c, pad=width - len(c), stream=f"{ins.stream:<7}", live=format_bytes(b))
                  for c, ins, b in zip(codes, program.instrs, live)]
    for line in (title, *summary, *passes):
        if "\n" in line:
            raise CodegenError("header lines must be single lines")
    return _env.get_template("step.py.j2").render(
        version=__version__, title=title, summary=summary, passes=passes,
        n_micro_batches=program.n_micro_batches, statements=statements)


def _plan_title(plan) -> str:
    ir = getattr(plan, "ir", None)
    if ir is None:
        return "step program"
    return (f"{ir.model}: micro-batch {ir.micro_batch} x {ir.seq_len} tokens, {ir.dtype}, "
            f"{plan.program.n_micro_batches} micro-batch(es) per step")


def _plan_summary(plan) -> list[str]:
    if not hasattr(plan, "peak_gpu_bytes"):
        return []
    lines = [f"GPU budget {format_bytes(plan.gpu_budget_bytes)}; predicted peak {format_bytes(plan.peak_gpu_bytes)} "
             f"(program buffers {format_bytes(plan.peak_buffer_bytes)}); host {format_bytes(plan.host_bytes)}",
             f"predicted step {plan.step_time_s * 1e3:.2f} ms, {plan.tokens_per_s:,.0f} tokens/s, "
             f"bottleneck {plan.bottleneck}"]
    return lines


def load(source: str, name: str = "megatrain_step") -> types.ModuleType:
    """Compile generated source into a module exposing `step(rt, batch, lr)`."""
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    if not callable(getattr(module, "step", None)):
        raise CodegenError("the source defines no step(rt, batch, lr) function")
    return module
