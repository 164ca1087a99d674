"""Sync insertion: add the record/wait pairs that make the concurrent streams equal the sequential program.

Where it sits: the `sync` pass, after lowering and buffer assignment; the verifier then checks the result
independently. Try it: `pytest tests/planner/test_sync.py -q`.

The lowered op list is correct when run one op at a time. Each op touches resources: its device buffers,
plus host-side ones the IR leaves implicit (a unit's host parameters, written by `optimizer_step` and read
by `load_params`; its host gradients, written by `store_grads` and read by `clip_grads`/`optimizer_step`;
host checkpoint copies; the clip factor). For every pair of conflicting accesses (read-after-write,
write-after-read, write-after-write) on different streams, the later op must wait for the earlier one.
Steps repeat, so the scan runs over two copies of the step: a conflict whose earlier access lies in the
previous step becomes a cross-step wait (its `wait` precedes its `record` in program order, ir/README.md).
Waits already implied by stream order and earlier waits are dropped (vector clocks), so the program keeps
only the necessary ones: the classic "last conflicting access per stream" rule.
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR

from .schedule import Op

STREAMS = ("compute", "h2d", "d2h", "host", "comm", "disk")
_TAGS = {"load_params": "load", "forward": "fwd", "backward": "bwd", "store_grads": "store",
         "optimizer_step": "opt", "offload_act": "offloaded", "load_act": "loaded", "alloc": "alloc",
         "free": "freed", "clip_grads": "clip", "all_gather": "gathered", "reduce_scatter": "reduced",
         "all_reduce": "reduced", "device_step": "dstep", "store_norms": "norms"}


def tied_owners(ir: ModelIR) -> dict[str, list[str]]:
    """unit -> the units owning parameters it holds a tied copy of (from the IR's `tied` edges)."""
    owners: dict[str, list[str]] = {}
    for src, dst, kind in ir.edges:
        if kind == "tied" and src != dst:
            owners.setdefault(dst, []).append(src)
    return owners


def accesses(op: Op, owners: dict[str, list[str]], users: dict[str, list[str]],
             unit_names: list[str], hgrad: dict[str, str] | None = None,
             on_device: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(resources read, resources written) by one op, host-side resources included. `hgrad` maps a unit to
    the host gradient buffer its gradients land in (`host_grad`); units that share one conflict on it.
    `on_device`: the units stepped by device_step, whose norms reach the host through store_norms
    (`host.norms:{unit}`) and whose step reads the clip factor."""
    name = op.op
    if name == "device_step":
        return op.reads + ("host.clip",), op.writes
    if name == "store_norms":
        return op.reads, (f"host.norms:{op.unit}",)

    def grads(u: str) -> str:
        return f"host.grads:{(hgrad or {}).get(u, u)}"
    if name == "load_params":
        return tuple(f"host.params:{u}" for u in (op.unit, *owners.get(op.unit, ()))), op.writes
    if name == "store_grads":
        return op.reads, tuple(grads(u) for u in (op.unit, *owners.get(op.unit, ())))
    if name == "optimizer_step":
        reads = tuple(grads(u) for u in (op.unit, *users.get(op.unit, ()))) + ("host.clip",)
        return reads, (f"host.params:{op.unit}",)
    if name == "clip_grads":
        return tuple(dict.fromkeys(f"host.norms:{u}" if u in on_device else grads(u) for u in unit_names)), \
            ("host.clip",)
    if name == "save_state":  # a checkpoint write reads the unit's host state, which its optimizer_step writes
        return (f"host.params:{op.unit}",), ()
    if name in ("alloc", "free"):
        return (), (op.buffer,)
    return op.reads, op.writes


def host_grad_names(ops) -> dict[str, str]:
    """unit -> `hgrad{k}`, from the program's store_grads (units without a host_grad keep their own)."""
    return {op.unit: f"hgrad{op.host_grad}" for op in ops if op.op == "store_grads" and op.host_grad is not None}


def event_names(ops: list[Op]) -> list[str]:
    """A readable, unique event name per op: `load.blocks.3`, `bwd.head.1`, `offloaded.carry.head.0`."""
    seen: dict[str, int] = {}
    names = []
    for op in ops:
        if op.buffer is not None:
            subject = op.buffer
        else:
            subject = ".".join(str(x) for x in (op.unit, op.mb) if x is not None) or "all"
        base = f"{_TAGS.get(op.op, op.op)}.{subject}"
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def _dependencies(ops: list[Op], acc: list[tuple]) -> list[list[tuple[int, int]]]:
    """Per op (in the second of two step copies): the latest conflicting access on each other stream,
    as (copy, index) with copy 0 = previous step, 1 = this step."""
    sid = [STREAMS.index(op.stream) for op in ops]
    last_write: dict[str, tuple[int, int]] = {}
    reads_since: dict[str, dict[int, tuple[int, int]]] = {}
    deps: list[list[tuple[int, int]]] = [[] for _ in ops]
    for copy in (0, 1):
        for i, (reads, writes) in enumerate(acc):
            s = sid[i]
            if copy == 1:
                latest: dict[int, tuple[int, int]] = {}
                sources = [last_write.get(r) for r in (*reads, *writes)]
                for w in writes:
                    sources.extend(reads_since.get(w, {}).values())
                for src in sources:
                    if src is not None and sid[src[1]] != s and src > latest.get(sid[src[1]], (-1, -1)):
                        latest[sid[src[1]]] = src
                deps[i] = sorted(latest.values(), reverse=True)
            for r in reads:
                reads_since.setdefault(r, {})[s] = (copy, i)
            for w in writes:
                last_write[w] = (copy, i)
                reads_since[w] = {}
    return deps


def insert_sync(ops: list[Op], ir: ModelIR, repeats: bool = True) -> tuple[list[Op], list[str]]:
    """The ops with record/wait inserted, and one decision line per kind of wait. `repeats=False`: a program
    run once, after the device drained (an evaluation): nothing of a previous run is waited for."""
    owners = tied_owners(ir)
    users: dict[str, list[str]] = {}
    for u, os in owners.items():
        for o in os:
            users.setdefault(o, []).append(u)
    names = [u.name for u in ir.units]
    hgrad = host_grad_names(ops)
    on_device = frozenset(op.unit for op in ops if op.op == "device_step")
    acc = [accesses(op, owners, users, names, hgrad, on_device) for op in ops]
    deps = _dependencies(ops, acc)
    if not repeats:
        deps = [[d for d in ds if d[0] == 1] for ds in deps]
    sid = [STREAMS.index(op.stream) for op in ops]
    counts = [sid.count(s) for s in range(len(STREAMS))]
    local, seen = [], [0] * len(STREAMS)
    for s in sid:
        local.append(seen[s])
        seen[s] += 1

    n = len(ops)
    seqs = ([local[j] for j in range(n)], [counts[sid[j]] + local[j] for j in range(n)])
    clocks: tuple[list, list] = ([None] * n, [None] * n)
    waits: list[list[tuple[int, int]]] = [[] for _ in ops]
    last = [(-1,) * len(STREAMS)] * len(STREAMS)
    for copy in (0, 1):
        mine = clocks[copy]
        for i in range(n):
            s = sid[i]
            clock = last[s]
            for src_copy, j in deps[i]:
                if copy == 0:
                    if src_copy == 0:
                        continue  # the step before the first is complete
                    src_copy = 0
                if clock[sid[j]] >= seqs[src_copy][j]:
                    continue  # already ordered
                clock = tuple(map(max, clock, clocks[src_copy][j]))
                if copy == 1:
                    waits[i].append((src_copy, j))
            clock = clock[:s] + (seqs[copy][i],) + clock[s + 1:]
            mine[i] = clock
            last[s] = clock

    events = event_names(ops)
    sources = {j for w in waits for _, j in w}
    out: list[Op] = []
    for i, op in enumerate(ops):
        for _, j in waits[i]:
            out.append(Op("wait", op.stream, event=events[j]))
        out.append(op)
        if i in sources:
            out.append(Op("record", op.stream, event=events[i]))
    n_cross = sum(1 for w in waits for c, _ in w if c == 0)
    n_wait = sum(len(w) for w in waits)
    decisions = [f"{len(sources)} events, {n_wait} waits ({n_cross} cross-step) for "
                 f"{sum(len(d) for d in deps)} cross-stream conflicts; the rest are implied by stream order"]
    return out, decisions
