"""The predicted timeline as a Chrome/Perfetto trace: one track per stream, a counter for device memory.

Where it sits: `megatrain plan --trace FILE`; open FILE in https://ui.perfetto.dev or chrome://tracing.
The estimate's three unrolled steps are drawn (the second and third are steady state), so the host
optimizer's overlap with the next step is visible. `predicted_spans` is the same data for the pictures
(series.py). Try it:
`megatrain plan --model tiny --hardware cpu --seq-len 128 --micro-batch 2 --trace tiny.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.files import write_atomic

from .collectives import cost_model
from .estimate import Estimate, estimate_time
from .timeline import program_timeline

if TYPE_CHECKING:
    from megatrain.ir.program import Instr

    from .plan import Plan

TRACKS = {"compute": 1, "h2d": 2, "d2h": 3, "host": 4, "comm": 5}


def plan_estimate(plan: Plan) -> Estimate:
    """The estimator's unrolled steps for a plan (per-instruction start and duration)."""
    return estimate_time(plan.program, cost_model(plan.ir, plan.hardware, plan.host_policy,
                                                  plan.train.clip_norm is not None, plan.world))


def predicted_spans(plan: Plan, est: Estimate) -> Iterator[tuple[int, int, Instr, float, float]]:
    """(unrolled step, instruction index, instruction, start s, duration s) of every instruction that takes
    time, step by step in program order."""
    for step, starts in enumerate(est.start_s):
        for i, ins in enumerate(plan.program.instrs):
            if est.duration_s[i] > 0:
                yield step, i, ins, starts[i], est.duration_s[i]


def span_label(ins: Instr) -> str:
    return ins.op + "(" + ", ".join(str(x) for x in (ins.unit, ins.buffer, ins.mb) if x is not None) + ")"


def trace_events(plan: Plan) -> list[dict]:
    est = plan_estimate(plan)
    tl = program_timeline(plan.program)
    gpu = {i: plan.hardware.gpu_bytes(v) for i, v in zip(tl.index, tl.total)}
    title = f"megatrain plan: {plan.ir.model} on {plan.hardware.name}"
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    for stream, tid in TRACKS.items():
        if stream == "comm" and plan.program.world_size == 1:  # a track only where collectives run
            continue
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": stream}})
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for starts in est.start_s:
        events.extend({"ph": "C", "pid": 1, "name": "device memory (GiB)", "ts": starts[i] * 1e6,
                       "args": {"GiB": round(v / 2**30, 4)}} for i, v in gpu.items())
    for step, i, ins, start, duration in predicted_spans(plan, est):
        events.append({"ph": "X", "pid": 1, "tid": TRACKS[ins.stream], "name": span_label(ins),
                       "ts": start * 1e6, "dur": duration * 1e6,
                       "args": {"step": step, "instruction": i, "slot": ins.slot,
                                "grad_slot": ins.grad_slot}})
    return events


def write_trace(plan: Plan, path: str | Path) -> None:
    """Write the trace JSON (microsecond timestamps) to `path`."""
    write_atomic(path, json.dumps({"traceEvents": trace_events(plan), "displayTimeUnit": "ms"}), "--trace")
