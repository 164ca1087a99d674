"""Streams that share a machine: op durations stretched by the measured slowdown of running beside each other.

Where it sits: the estimator (estimate.py) calls `contended` when the cost model carries contention factors,
which come from a measured unit profile (`UnitProfile.contention`, runtime/unit_probe.py). A CUDA GPU's
streams are separate engines (factors absent or 1: the plain DAG); the sim device's four stream workers,
torch's intra-op threads and the Python interpreter lock share the host's cores, so an op that overlaps
another stream's work runs slower than alone. Try it: `pytest tests/planner/test_profile.py -q`.

Model (measured, not fitted): the probe times a representative op of each stream alone and while another
stream is kept busy, giving factors f[s][t] >= 1 (op on stream s, stream t busy). An op of stream s whose
span overlaps stream t's work for a fraction o_t of its length takes d x (1 + sum_t o_t (f[s][t] - 1)): it is
slowed for the part of its life it shares. The overlaps depend on the durations, so the schedule is solved
by a damped fixed point over the unrolled steps (the DAG's own pass, `unrolled_finish`), overlaps
read on the middle step, which sees both neighbours (the host optimizer of one step runs beside the next
step's forward). It assumes slowdowns add across streams and do not depend on which op of the other stream
runs; the probe measures each pair with the ops that dominate their streams.
"""

from __future__ import annotations

from bisect import bisect_left

WORK = frozenset(("forward", "backward", "load_params", "load_act", "store_grads", "offload_act",
                  "optimizer_step", "clip_grads", "device_step", "store_norms"))
ITERATIONS = 8
STEPS = 4  # unrolled: the middle steps see a neighbour on each side


def contended(instrs, durations: list[float], costs) -> list[float]:
    """Per-instruction durations of a steady step with every work op stretched by its overlaps (see the
    module docstring); `durations` are the ops alone."""
    factors = costs.contention
    n = len(instrs)
    base = list(durations)
    d = list(durations)
    work = [i for i, ins in enumerate(instrs) if ins.op in WORK]
    streams = sorted({ins.stream for ins in instrs})
    mid = STEPS // 2
    for _ in range(ITERATIONS):
        finish = unrolled_finish(instrs, d, STEPS, costs.event_latency_s, costs.step_gap_s)
        spans = {s: [] for s in streams}
        for c in range(STEPS):
            for i in work:
                spans[instrs[i].stream].append((finish[c][i] - d[i], finish[c][i]))
        for s in spans:
            spans[s].sort()
        starts = {s: [a for a, _ in v] for s, v in spans.items()}
        new = list(d)
        for i in work:
            s = instrs[i].stream
            a, b = finish[mid][i] - d[i], finish[mid][i]
            if b <= a:
                continue
            extra = 0.0
            for t, f in factors.get(s, {}).items():
                if t != s and f > 1.0 and t in spans:
                    extra += _overlap(spans[t], starts[t], a, b) / (b - a) * (f - 1.0)
            new[i] = base[i] * (1.0 + extra)
        d = [0.5 * (x + y) for x, y in zip(d, new)]
    return d[:n]


def _overlap(spans: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Seconds of [a, b] covered by the (disjoint, sorted) spans."""
    k = max(0, bisect_left(starts, a) - 1)
    total = 0.0
    while k < len(spans) and spans[k][0] < b:
        lo, hi = max(a, spans[k][0]), min(b, spans[k][1])
        if hi > lo:
            total += hi - lo
        k += 1
    return total


def unrolled_finish(instrs, durations: list[float], steps: int, event_latency: float = 0.0,
                    step_gap: float = 0.0) -> list[list[float]]:
    """Finish time of every instruction of every unrolled step, by one pass in program order (the DAG's
    semantics: stream order, record -> wait with `event_latency` across streams, and each step issued
    `step_gap` after the previous step's last compute instruction)."""
    records = {ins.event: i for i, ins in enumerate(instrs) if ins.op == "record"}
    n = len(instrs)
    finish = [[0.0] * n for _ in range(steps)]
    last: dict[str, float] = {}
    last_compute = max((i for i, ins in enumerate(instrs) if ins.stream == "compute"), default=None)
    for c in range(steps):
        fc = finish[c]
        issued = finish[c - 1][last_compute] + step_gap if c and last_compute is not None else 0.0
        seen: set[str] = set()
        for i, ins in enumerate(instrs):
            start = last.get(ins.stream, 0.0)
            if ins.stream not in seen:
                seen.add(ins.stream)
                start = max(start, issued)
            if ins.op == "wait":
                r = records.get(ins.event)
                lat = event_latency if r is not None and instrs[r].stream != ins.stream else 0.0
                if r is not None and r < i:
                    start = max(start, fc[r] + lat)
                elif r is not None and c > 0:
                    start = max(start, finish[c - 1][r] + lat)
            fc[i] = start + durations[i]
            last[ins.stream] = fc[i]
    return finish
