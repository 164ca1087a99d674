"""The measured timeline of training steps as a Chrome/Perfetto trace.

Where it sits: `megatrain train --trace FILE` turns the engine's recorded spans (engine.timeline) into the
same layout as the planner's predicted trace (`megatrain plan --trace`): one track per stream and a counter
for device buffer bytes, so the two can be opened side by side in https://ui.perfetto.dev. `measured_series`
picks one step out of the same spans for `megatrain train --plot` (megatrain/plots.py draws it).
On CUDA, GPU-stream spans come from CUDA events (device time); host spans are wall time.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from megatrain.files import write_atomic
from megatrain.ir.base import IRModel
from megatrain.planner.series import Span

TRACKS = {"compute": 1, "h2d": 2, "d2h": 3, "host": 4, "comm": 5, "disk": 6}  # the last two where they ran
UNIT_OPS = ("load_params", "forward", "backward", "store_grads", "optimizer_step", "device_step", "store_norms")


def write_measured_trace(spans: list[tuple], path: str | Path, title: str) -> int:
    """Write spans from Engine.measured_spans() as trace JSON (microseconds); returns the span count."""
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    ran = {s[0] for s in spans}
    for stream, tid in TRACKS.items():
        if tid <= 4 or stream in ran:
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": stream}})
    for stream, label, step, start, end, mem in spans:
        events.append({"ph": "X", "pid": 1, "tid": TRACKS[stream], "name": label.split(" (step")[0],
                       "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": {"step": step}})
        if stream == "compute":
            events.append({"ph": "C", "pid": 1, "name": "device buffers (MiB)", "ts": end * 1e6,
                           "args": {"MiB": round(mem / 2**20, 4)}})
    write_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), "--trace")
    return len(spans)


class MeasuredSeries(IRModel):
    """One measured step as the run picture draws it (`megatrain train --plot`), beside the plan's
    prediction (planner/series.py): busy spans per stream and device buffer bytes, seconds from the step's
    first span."""

    step: int = Field(description="the step number as the metrics count it (1 = the first step trained)")
    spans: tuple[Span, ...]
    memory: tuple[tuple[float, int], ...] = Field(description="(s, pool bytes) after each compute-stream op, "
                                                  "starting with what the previous step left")
    end_s: float
    peak_bytes: int


def measured_series(spans: list[tuple], step: int | None = None) -> MeasuredSeries:
    """Spans from Engine.measured_spans() of `step` (counted from 1 like the metrics; default: the last one
    recorded), plus the previous step's that still ran into it."""
    if not spans:
        raise ValueError("no measured spans: start the engine's timeline before training "
                         "(engine.start_timeline())")
    index = max(s[2] for s in spans) if step is None else step - 1  # the engine counts steps from 0
    mine = [s for s in spans if s[2] == index]
    if not mine:
        raise ValueError(f"no measured spans for step {step}")
    t0 = min(s[3] for s in mine)
    out, memory = [], []
    before = [s for s in spans if s[0] == "compute" and s[4] <= t0]
    if before:
        memory.append((0.0, max(before, key=lambda s: s[4])[5]))
    for stream, label, k, start, end, mem in spans:
        if k == index or (k == index - 1 and end > t0):
            op, _, rest = label.partition("(")
            unit = rest.split(",")[0].rstrip(")") if op in UNIT_OPS else None
            out.append(Span(lane=stream, op=op, unit=unit, start=max(start - t0, 0.0), end=end - t0,
                            previous=k != index))
            if stream == "compute" and k == index:
                memory.append((end - t0, mem))
    memory.sort()
    return MeasuredSeries(step=index + 1, spans=tuple(out), memory=tuple(memory),
                          end_s=max(s.end for s in out if not s.previous),
                          peak_bytes=max(m for _, m in memory))
