"""Span tracing of the engine's ops: what `megatrain train --trace` and the unit probe read.

Where it sits: a mixin of the Engine (engine.py). `start_timeline()` makes every op submitted from then on
record (stream, label, step, start, end, pool bytes); `measured_spans()` drains the device and resolves them
into seconds from the start. Host-stream and sim-device ops are timed by the wall clock, GPU streams by CUDA
events, so a span is the op's time on its stream, not its issue.
"""

from __future__ import annotations

import time

import torch


class Spans:
    """The engine's span recording (needs `device` and `step_index`)."""

    timeline: list[tuple] | None = None  # (stream, label, step, start, end, pool bytes) while recording

    def start_timeline(self) -> None:
        """Record every op's span from now on (see measured_spans)."""
        self.timeline = []
        self._t0 = time.perf_counter()
        self._t0_event = None
        if self.device.kind == "cuda":
            self._t0_event = torch.cuda.Event(enable_timing=True)
            self._t0_event.record()

    def measured_spans(self) -> list[tuple[str, str, int, float, float, int]]:
        """(stream, label, step, start s, end s, pool bytes) after the device drains; CUDA events resolved."""
        self.device.synchronize()
        out = []
        for stream, label, step, a, b, mem in self.timeline or []:
            if not isinstance(a, float):
                a, b = self._t0_event.elapsed_time(a) / 1e3, self._t0_event.elapsed_time(b) / 1e3
            else:
                a, b = a - self._t0, b - self._t0
            out.append((stream, label, step, a, b, mem))
        return sorted(out, key=lambda s: s[3])

    def _timed(self, stream: str, label: str, fn):
        """Wrap an op to record its span: wall time on sim and host, CUDA events on GPU streams."""
        gpu = self.device.kind == "cuda" and stream not in ("host", "disk")  # those two are host threads
        step = self.step_index

        def run():
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
            else:
                start = time.perf_counter()
                fn()
                end = time.perf_counter()
            self.timeline.append((stream, label, step, start, end, self.device.pool.current))

        return run
