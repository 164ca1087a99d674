"""Helpers for the planner tests: random synthetic models and hardware (hypothesis), real presets traced
once per session, an independent memory timeline, and program surgery for hand-broken programs.

Imported by tests/planner/test_*.py as `planner_testing` (a unique name: test folders are not packages).
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Program
from megatrain.planner import Hardware
from megatrain.planner.loading import trace_model as _trace_model
from megatrain.planner.synthetic import build_ir


@functools.cache
def traced(model, micro_batch: int, seq_len: int, dtype: str = "bfloat16", target: str = "cuda") -> ModelIR:
    """A real preset's (or a ModelConfig's) ModelIR, traced once per session."""
    return _trace_model(model, micro_batch, seq_len, dtype, target)


@st.composite
def model_irs(draw, max_blocks: int = 6) -> ModelIR:
    """Random synthetic models: heterogeneous units, carries that change size along depth, maybe tied."""
    n = draw(st.integers(1, max_blocks)) + 2
    units = []
    for _ in range(n):
        fwd = draw(st.integers(0, 10**9))
        units.append(dict(flat_numel=draw(st.integers(1, 5000)), carry_out=draw(st.integers(1, 3000)),
                          flops_fwd=fwd, flops_bwd=draw(st.integers(0, 3 * 10**9)),
                          saved_bytes=draw(st.integers(0, 20000)), peak_fwd_bytes=draw(st.integers(0, 8000)),
                          peak_bwd_bytes=draw(st.integers(0, 30000))))
    return build_ir(units, tied=draw(st.booleans()), resident_bytes=draw(st.integers(0, 500)))


@st.composite
def hardwares(draw) -> Hardware:
    """Rates that make compute, links and the host optimizer all plausible bottlenecks on model_irs()."""
    flops = draw(st.floats(1e8, 1e10))
    return Hardware(name="random", gpu_memory_bytes=10**9, matmul_flops={"bfloat16": flops, "float32": flops / 4},
                    peak_flops={"bfloat16": flops * 1.3, "float32": flops / 3},
                    h2d_bytes_per_s=draw(st.floats(1e3, 1e5)), d2h_bytes_per_s=draw(st.floats(1e3, 1e5)),
                    host_memory_bytes=10**9, host_memory_bytes_per_s=draw(st.floats(1e4, 1e6)),
                    allocator_margin=draw(st.sampled_from([0.0, 0.05, 0.1])),
                    reserved_bytes=draw(st.sampled_from([0, 1000])), op_overhead_s=0.0, copy_latency_s=0.0)


def drawn_program(ir: ModelIR, data) -> Program:
    """A step program of `ir` under decisions drawn from hypothesis `data` (slots, gradient slots, per-unit
    placement, optimizer split, micro-batches, clipping)."""
    from program_testing import program_for

    from megatrain.planner.schedule import Decisions

    n = len(ir.units)
    place = ("device",) + tuple(data.draw(st.sampled_from(["device", "host", "keep"])) for _ in range(n - 1))
    dec = Decisions(data.draw(st.integers(1, n)), data.draw(st.integers(1, 2)), place, data.draw(st.integers(0, n)))
    return program_for(ir, data.draw(st.integers(1, 2)), dec, clip=data.draw(st.booleans()))


def independent_timeline(program: Program, kinds=None) -> tuple[list[int], list[int]]:
    """(buffers + workspace, buffers) per compute-stream instruction, straight from megatrain/ir/README.md's rule:
    static buffers live all step; a dynamic buffer starts at `alloc` or its first compute writer and
    ends at `free`. With `kinds`, only buffers of those kinds count. Written separately from
    megatrain/planner/timeline.py on purpose."""
    size = {b.name: b.nbytes if kinds is None or b.kind in kinds else 0 for b in program.buffers}
    static = sum(size[b.name] for b in program.buffers if b.static)
    alive: dict[str, int] = {}
    totals, buffers = [], []
    for ins in program.instrs:
        if ins.stream != "compute":
            continue
        if ins.op == "alloc":
            alive[ins.buffer] = size[ins.buffer]
        if ins.op == "free":
            alive.pop(ins.buffer)
        for w in ins.writes if ins.op in ("forward", "backward") else ():
            if not program.buffer(w).static:
                alive.setdefault(w, size[w])
        now = static + sum(alive.values())
        buffers.append(now)
        totals.append(now + (ins.workspace_bytes if ins.op in ("forward", "backward", "device_step") else 0))
    return totals, buffers


def without(program: Program, index: int) -> Program:
    """The program with instruction `index` removed."""
    instrs = program.instrs[:index] + program.instrs[index + 1:]
    return program.replace(instrs=instrs)


def find(program: Program, **fields) -> int:
    """Index of the first instruction whose fields match."""
    for i, ins in enumerate(program.instrs):
        if all(getattr(ins, k) == v for k, v in fields.items()):
            return i
    raise LookupError(fields)
