"""Step time: the critical path of the instruction DAG (networkx), with op costs from the profile.

Where it sits: the `estimate` pass; the CLI's summary, bottleneck and `--trace` read its result. The only
planner module that imports networkx. Try it: `pytest tests/planner/test_estimate.py -q`.

Nodes are instructions, weighted by their seconds (costs.py); edges are stream order (one stream runs its
instructions one at a time) and record -> wait. An instruction starts when all its predecessors finish, so
finish times are longest paths and the step's end is the critical path. The graph holds one step; edges
into the next step carry delay 1, and the longest paths sweep it once per unrolled step in program order
(a topological order of a step; tests check it against `step_period`, a plain pass over the program).

NOTE (steady state): the host optimizer overlaps the next step: its `load_params(u)` waits only for
`optimizer_step(u)`, so the next forward streams right behind the optimizer (docs/DESIGN.md 4.5). We unroll three
steps, joined by the cross-step waits (a wait whose record comes later in the program waits for the
previous step's record), and report the period between the ends of the second and the third step. The first
step has no predecessor to wait for, the second is already steady for this schedule's shape (each step
depends only on its predecessor), and the third measures it. The bottleneck is the resource that holds the
critical path longest within that period; its share is that time over the period.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from megatrain.ir.program import Program

from .contention import contended, unrolled_finish
from .costs import CostModel

RESOURCES = {"forward": "compute", "backward": "compute", "load_params": "h2d", "load_act": "h2d",
             "store_grads": "d2h", "offload_act": "d2h", "optimizer_step": "host_optimizer",
             "clip_grads": "host_optimizer", "all_gather": "collectives", "reduce_scatter": "collectives",
             "all_reduce": "collectives", "device_step": "compute", "store_norms": "d2h"}
STEPS = 3


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    first_step_s: float
    critical_s: dict[str, float]
    busy_s: dict[str, float]
    bottleneck: str
    bottleneck_share: float
    start_s: tuple[tuple[float, ...], ...]  # per unrolled step, per instruction
    duration_s: tuple[float, ...]


def instruction_dag(program: Program, event_latency: float = 0.0, step_gap: float = 0.0) -> nx.DiGraph:
    """The DAG of one step: node i is instruction i; edges are stream order and record -> wait, the
    latter with `delay=1` when the wait precedes its record (it waits for the previous step's record).
    Unrolled over steps (delay-1 edges joining consecutive steps) it is acyclic; within a step every
    delay-0 edge points forward in program order. An edge's `latency` is seconds between its source's end
    and its target's start: `event_latency` for a wait on another stream's record (the blocked worker's
    wake-up), and `step_gap` from the last compute instruction of a step to the first instruction of every
    stream in the next (the runtime issues a step once the previous step's compute has ended)."""
    records = {ins.event: i for i, ins in enumerate(program.instrs) if ins.op == "record"}
    g = nx.DiGraph()
    g.add_nodes_from(range(len(program.instrs)))
    last: dict[str, int] = {}
    first: dict[str, int] = {}
    edges = []
    for i, ins in enumerate(program.instrs):
        prev = last.get(ins.stream)
        if prev is not None:
            edges.append((prev, i, 0, 0.0))
        last[ins.stream] = i
        first.setdefault(ins.stream, i)
        if ins.op == "wait":
            r = records.get(ins.event)
            if r is not None:
                lat = event_latency if program.instrs[r].stream != ins.stream else 0.0
                edges.append((r, i, 0 if r < i else 1, lat))
    for stream, i in last.items():  # the stream carries on into the next step
        edges.append((i, first[stream], 1, 0.0))
    if "compute" in last:
        for f in first.values():  # the next step is issued once this step's compute has ended
            edges.append((last["compute"], f, 1, step_gap))
    for u, v, delay, lat in edges:
        if g.has_edge(u, v) and g[u][v]["delay"] == delay:
            g[u][v]["latency"] = max(g[u][v]["latency"], lat)
        else:
            g.add_edge(u, v, delay=delay, latency=lat)
    return g


def longest_paths(g: nx.DiGraph, durations: list[float], steps: int = STEPS) -> tuple[list[float], list]:
    """Finish time of every instruction of every unrolled step (index step * n + i) and its critical
    predecessor. Program order is a topological order of each step, so one sweep per step suffices."""
    n = g.number_of_nodes()
    finish = [0.0] * (steps * n)
    critical: list[int | None] = [None] * (steps * n)
    preds = [[(p, d["delay"], d.get("latency", 0.0)) for p, d in g.pred[i].items()] for i in range(n)]
    for c in range(steps):
        base = c * n
        for i in range(n):
            best, start = None, 0.0
            for p, delay, lat in preds[i]:
                if delay and c == 0:
                    continue  # the step before the first is complete
                src = base - delay * n + p
                if best is None or finish[src] + lat > start:
                    best, start = src, finish[src] + lat
            critical[base + i] = best
            finish[base + i] = start + durations[i]
    return finish, critical


def estimate_time(program: Program, costs: CostModel) -> Estimate:
    sizes = {b.name: b.nbytes for b in program.buffers}
    warm = costs.warm_flags(program.instrs)
    durations = [costs.op_seconds(ins, sizes, w) for ins, w in zip(program.instrs, warm)]
    if costs.contention:
        durations = contended(program.instrs, durations, costs)
    n = len(program.instrs)
    finish, critical_pred = longest_paths(instruction_dag(program, costs.event_latency_s, costs.step_gap_s),
                                          durations)
    ends = [max(finish[c * n:(c + 1) * n]) for c in range(STEPS)]
    lo, hi = ends[-2], ends[-1]
    step = hi - lo
    critical = dict.fromkeys(("compute", "h2d", "d2h", "host_optimizer", "collectives"), 0.0)
    node: int | None = max(range((STEPS - 1) * n, STEPS * n), key=lambda v: finish[v])
    while node is not None and finish[node] > lo:
        ins = program.instrs[node % n]
        start = finish[node] - durations[node % n]
        if ins.op in RESOURCES:
            critical[RESOURCES[ins.op]] += finish[node] - max(start, lo)
        node = critical_pred[node]
    busy = dict.fromkeys(critical, 0.0)
    for i, ins in enumerate(program.instrs):
        if ins.op in RESOURCES:
            busy[RESOURCES[ins.op]] += durations[i]
    bottleneck = max(critical, key=lambda k: critical[k])
    share = critical[bottleneck] / step if step > 0 else 1.0
    starts = tuple(tuple(finish[c * n + i] - durations[i] for i in range(n)) for c in range(STEPS))
    return Estimate(step_time_s=step, first_step_s=ends[0], critical_s=critical, busy_s=busy,
                    bottleneck=bottleneck, bottleneck_share=min(1.0, share), start_s=starts,
                    duration_s=tuple(durations))


def step_period(instrs, durations: list[float], steps: int = STEPS, event_latency: float = 0.0,
                step_gap: float = 0.0) -> tuple[float, float]:
    """(steady step, first step) by one pass in unrolled program order, which is a topological order of
    the DAG above: the same finish times as `estimate_time`, without building a graph. For searches."""
    finish = unrolled_finish(instrs, durations, steps, event_latency, step_gap)
    ends = [max(fc) for fc in finish]
    return ends[-1] - ends[-2], ends[0]
