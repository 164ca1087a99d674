"""Collectives in the Program: the `collectives` pass, their costs, and the verifier's checks of them.

Where it sits: `plan(..., world=World(nproc=R))` (passes.py) runs the `collectives` pass after `lower`: it
rewrites one rank's lowered op list so the model state is sharded across the R ranks (world.py holds the
layout). The sync pass then orders the new ops like any other (they name the slots they read and write), the
verifier checks them (`check_collectives`, called by verify.py), and the estimator prices them
(`WorldCostModel`). Try it: `megatrain plan --model tiny --hardware cpu --seq-len 64 --grad-accum 2 --nproc 2
--program`.

The rewrite, per unit (ir/README.md has each op's line):
- sharded units: `load_params(shard=True)` brings only the rank's shard over the link, then `all_gather` on
  the `comm` stream completes the slot; after the unit's last backward, `reduce_scatter` sums its gradients
  across ranks leaving the rank's shard (and writes the shard's per-parameter norms), and `store_grads(shard=True)`
  copies that shard to the host, where the rank's optimizer steps it;
- replicated units (a tied parameter's holder and owner, world.py): a whole load, `all_reduce` of the
  gradients, a whole store; every rank steps the whole unit;
- device units (residency.py; never replicated, can_reside refuses tied units): `reduce_scatter` before
  their `store_norms`, their `device_step` steps the rank's shard, and `all_gather` of the slot after it
  completes the weights for the next forward; a "weights" unit is a sharded unit loaded once a step;
- no backward writes norms (`norm`): the gradient collective writes the norms of what the rank keeps;
  clip_grads all-reduces their squares (the runtime's sharded store).
The comm stream runs its collectives in program order, the same order on every rank (they run the same
program), so a unit's reduce_scatter overlaps the next unit's backward and a prefetch's all_gather the
forward of the unit before.

Costs (ring algorithms, per GPU and direction; NCCL's are what these model): a collective over R ranks on N
nodes of L = R / N ranks moving a B-byte buffer is hierarchical, its intra-node part over the GPUs' own links
and its inter-node part over each GPU's own NIC:
  all_gather, reduce_scatter: (L-1)/L x B / intra + (N-1)/N x (B/L) / inter + latency
  all_reduce: twice that (a reduce-scatter then an all-gather).
An all_gather moves the unit in the compute dtype, a reduce_scatter its fp32 gradients. Loads, stores and the
host optimizer shrink to the rank's shard (1/R of a sharded unit); the ranks of a node share its host memory
bandwidth (its sockets: a rank's optimizer and staging casts get min(L, sockets) / L of the node's), while
each GPU keeps its own host link (one PCIe x16 per GPU, as in DGX systems). NOTE: on a machine whose GPUs have
no NVLink the intra-node collectives share PCIe with the host<->device copies; the model does not charge that
contention (set intra_node_bytes_per_s to what a probe of both at once measures).
"""

from __future__ import annotations

import math

from megatrain.ir.base import dtype_bytes
from megatrain.ir.model_ir import ModelIR

from .costs import CostModel, load_seconds_per_element
from .hardware import Hardware
from .host_policy import HostPolicy
from .schedule import Op
from .world import World, replicated_units

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


# -- the pass ----------------------------------------------------------------------------------------------------
def lower_collectives(ops: list[Op], ir: ModelIR, world: World) -> list[Op]:
    """One rank's op list with the world's collectives: shard loads and stores, all_gather after each sharded
    load, a gradient collective before each store; no backward writes norms."""
    if world.nproc == 1:
        return list(ops)
    whole = replicated_units(ir)
    out: list[Op] = []
    for op in ops:
        f = op.fields()
        if op.op == "load_params" and op.unit not in whole:
            out.append(Op(**{**f, "shard": True}))
            slot = f"slot{op.slot}"
            out.append(Op("all_gather", "comm", unit=op.unit, slot=op.slot, reads=(slot,), writes=(slot,)))
        elif op.op == "backward" and op.norm:
            out.append(Op(**{**f, "norm": False}))
        elif op.op == "store_grads":
            grad = f"grad{op.grad_slot}"
            kind = "all_reduce" if op.unit in whole else "reduce_scatter"
            out.append(Op(kind, "comm", unit=op.unit, grad_slot=op.grad_slot, reads=(grad,), writes=(grad,)))
            out.append(Op(**{**f, "shard": op.unit not in whole}))
        elif op.op == "store_norms":  # a device unit (never replicated: can_reside refuses tied units)
            grad = f"grad{op.grad_slot}"
            out.append(Op("reduce_scatter", "comm", unit=op.unit, grad_slot=op.grad_slot, reads=(grad,),
                          writes=(grad,)))
            out.append(op)
        elif op.op == "device_step":  # it stepped the rank's shard of the slot: the others' complete it
            slot = f"slot{op.slot}"
            out += [op, Op("all_gather", "comm", unit=op.unit, slot=op.slot, reads=(slot,), writes=(slot,))]
        else:
            out.append(op)
    return out


def decision_lines(ir: ModelIR, world: World, ops: list[Op]) -> list[str]:
    whole = sorted(replicated_units(ir))
    counts = {k: sum(1 for op in ops if op.op == k) for k in COLLECTIVES}
    lines = [f"{world}: every unit's flat buffer padded to {world.nproc} equal shards; each rank holds 1/"
             f"{world.nproc} of every sharded unit's master, moments and host gradients",
             f"{counts['all_gather']} all_gather (after each shard load), {counts['reduce_scatter']} reduce_scatter"
             f" and {counts['all_reduce']} all_reduce (before each store) on the comm stream, in program order"]
    device = [op.unit for op in ops if op.op == "device_step"]
    if device:
        lines.append(f"stepped on the device, each rank its shard ({', '.join(device)}): reduce_scatter before "
                     "store_norms, all_gather of the stepped slot after device_step")
    if whole:
        lines.append(f"replicated (tied parameters: every rank holds and steps them whole): {', '.join(whole)}")
    return lines


# -- costs ---------------------------------------------------------------------------------------------------------
def collective_seconds(nbytes: float, world: World, hw: Hardware, passes: int = 1) -> float:
    """Seconds of a ring all_gather or reduce_scatter of an `nbytes` buffer over the world (`passes` 2: an
    all_reduce)."""
    L, N = world.ranks_per_node, world.nnodes
    t = 0.0
    if L > 1:
        t += (L - 1) / L * nbytes / _rate(hw, "intra_node_bytes_per_s")
    if N > 1:
        t += (N - 1) / N * nbytes / L / _rate(hw, "inter_node_bytes_per_s")
    return passes * (t + hw.collective_latency_s)


def _rate(hw: Hardware, field: str) -> float:
    rate = getattr(hw, field)
    if rate is None:
        what = "between the GPUs of a node" if field.startswith("intra") else "between nodes, per GPU"
        raise ValueError(f"hardware {hw.name!r} has no {field} (the bandwidth {what}) to price collectives with; "
                         f"add it to the profile JSON, or use a preset that has it (h100-sxm, h200, ...)")
    return rate


def host_share(hw: Hardware, world: World) -> float:
    """The fraction of its node's host memory bandwidth one rank's optimizer and staging casts get."""
    L = world.ranks_per_node
    return min(L, hw.host_sockets) / L


class WorldCostModel(CostModel):
    """CostModel of one rank of `world` on a padded IR: shard-sized loads, stores and optimizer steps, shared
    host bandwidth, and the collectives."""

    def __init__(self, ir: ModelIR, hw: Hardware, policy: HostPolicy | str, clip: bool, world: World,
                 cast: str | None = None):
        super().__init__(ir, hw, policy, clip, cast)
        self.world = world
        R, whole = world.nproc, replicated_units(ir)
        db, share = dtype_bytes(ir.dtype), host_share(hw, world)
        per = load_seconds_per_element(hw, ir.dtype, self.cast, share)
        rate = self.opt_rate * share
        frac = [1.0 if u.name in whole else 1.0 / R for u in ir.units]
        self.load = [u.flat_numel * f * per + hw.copy_latency_s for u, f in zip(ir.units, frac)]
        self.store = [u.flat_numel * f * self.policy.grad_bytes / hw.d2h_bytes_per_s + hw.copy_latency_s
                      for u, f in zip(ir.units, frac)]
        self.opt = [u.n_params * f * self.policy.traffic / rate * self.copy_factor for u, f in zip(ir.units, frac)]
        self.gather = [collective_seconds(u.flat_numel * db, world, hw) for u in ir.units]
        self.reduce = [collective_seconds(u.flat_numel * 4, world, hw, 2 if u.name in whole else 1)
                       for u in ir.units]
        self.clip += hw.collective_latency_s  # the squared norms' all-reduce: a few bytes
        self.dstep = [d * f for d, f in zip(self.dstep, frac)]  # a device unit steps the rank's shard
        # a checkpoint's files (runtime/checkpoint_stream.py): each rank writes its shard of a sharded unit and
        # rank 0 a replicated unit's whole file (priced: the rank that writes the most); a node's ranks write
        # (and a resume reads) through the node's one disk at once
        L = world.ranks_per_node
        self.save_bytes = [math.ceil(b * f) for b, f in zip(self.save_bytes, frac)]
        self.save = [b * L / hw.disk_write_bytes_per_s + hw.disk_file_latency_s for b in self.save_bytes]
        self.read = [b * L / hw.disk_read_bytes_per_s + hw.disk_file_latency_s for b in self.save_bytes]

    def op_seconds(self, ins, sizes: dict[str, int] | None = None, warm: bool = False) -> float:
        if ins.op == "all_gather":
            return self.gather[self.index[ins.unit]]
        if ins.op in ("reduce_scatter", "all_reduce"):
            return self.reduce[self.index[ins.unit]]
        return super().op_seconds(ins, sizes, warm)


def cost_model(ir: ModelIR, hw: Hardware, policy: HostPolicy | str, clip: bool, world: World | None,
               cast: str | None = None) -> CostModel:
    if world is None or world.nproc == 1:
        return CostModel(ir, hw, policy, clip, cast)
    return WorldCostModel(ir, hw, policy, clip, world, cast)


# -- the verifier's checks -------------------------------------------------------------------------------------------
def check_collectives(program, hb, at) -> list[str]:
    """Violations of the world rules (ir/README.md) in `program`, given its happens-before `hb` (verify.py)
    and the verifier's instruction formatter `at(i, ins)`."""
    instrs = program.instrs
    coll = [i for i, ins in enumerate(instrs) if ins.op in COLLECTIVES]
    if program.world_size == 1:
        bad = coll + [i for i, ins in enumerate(instrs) if ins.shard]
        return [f"{at(i, instrs[i])} belongs to a program of several ranks, but world_size is 1" for i in bad[:3]]
    problems = []
    gathered = {instrs[i].unit for i in coll if instrs[i].op == "all_gather"}
    loads: dict[int, list[int]] = {}
    gathers: dict[int, list[int]] = {}
    for i, ins in enumerate(instrs):
        if ins.op in ("load_params", "device_step"):  # what writes the rank's shard of the slot
            loads.setdefault(ins.slot, []).append(i)
            if ins.op == "device_step":
                continue
            if ins.shard != (ins.unit in gathered):
                want = "be all-gathered after it" if ins.shard else "load its shard (shard=True)"
                problems.append(f"{at(i, ins)}: a {'sharded' if ins.shard else 'whole'} load, so {ins.unit} must "
                                f"{want}")
        elif ins.op == "all_gather":
            gathers.setdefault(ins.slot, []).append(i)
        elif ins.op == "backward" and ins.norm:
            problems.append(f"{at(i, ins)} writes norms, but in a world program the gradient collective does")
    for i, ins in enumerate(instrs):
        if ins.op == "device_step" and ins.unit not in gathered:
            problems.append(f"{at(i, ins)} steps only the rank's shard: {ins.unit}'s slot needs an all_gather after it")
    for i, ins in enumerate(instrs):
        if ins.op == "all_gather":
            load = _latest(loads.get(ins.slot, []), i)
            if load is None or instrs[load[1]].unit != ins.unit:
                problems.append(f"{at(i, ins)} gathers {ins.unit}, but slot{ins.slot} was last loaded (or "
                                f"stepped) with {instrs[load[1]].unit if load else 'nothing'}")
            elif not hb.before(load, (1, i)):
                problems.append(f"{at(i, ins)} may run before {at(load[1], instrs[load[1]])} completes (missing wait)")
        elif ins.op in ("forward", "backward") and ins.unit in gathered:
            g, load = _latest(gathers.get(ins.slot, []), i), _latest(loads.get(ins.slot, []), i)
            if g is None or instrs[g[1]].unit != ins.unit or (load is not None and load > g):
                problems.append(f"{at(i, ins)} reads slot{ins.slot} before all_gather({ins.unit}) completed it")
            elif not hb.before(g, (1, i)):
                problems.append(f"{at(i, ins)} may run before {at(g[1], instrs[g[1]])} completes (missing wait)")
    problems += _check_gradients(instrs, hb, at, gathered)
    return problems


def _check_gradients(instrs, hb, at, gathered: set[str]) -> list[str]:
    problems = []
    bwd: dict[str, list[int]] = {}
    grads: dict[str, list[int]] = {}
    store: dict[str, int] = {}
    readers: dict[str, list[int]] = {}  # a device unit's store_norms and device_step read the reduced shard
    for i, ins in enumerate(instrs):
        if ins.op == "backward":
            bwd.setdefault(ins.unit, []).append(i)
        elif ins.op in ("reduce_scatter", "all_reduce"):
            grads.setdefault(ins.unit, []).append(i)
        elif ins.op == "store_grads":
            store[ins.unit] = i
        elif ins.op in ("store_norms", "device_step"):
            readers.setdefault(ins.unit, []).append(i)
    for unit, idx in bwd.items():
        mine = grads.get(unit, [])
        if len(mine) != 1:
            problems.append(f"unit {unit} has {len(mine)} gradient collectives; it needs exactly one per step")
            continue
        c = mine[0]
        ins = instrs[c]
        want = "reduce_scatter" if unit in gathered else "all_reduce"
        if ins.op != want:
            problems.append(f"{at(c, ins)}: {unit} is {'sharded' if unit in gathered else 'replicated'}, so its "
                            f"gradients need {want}")
        if ins.grad_slot != instrs[idx[0]].grad_slot:
            problems.append(f"{at(c, ins)} reduces grad{ins.grad_slot}, but backward({unit}) wrote "
                            f"grad{instrs[idx[0]].grad_slot}")
        for b in idx:
            if not hb.before((1, b), (1, c)):
                problems.append(f"{at(c, ins)} may run before {at(b, instrs[b])} completes (missing wait)")
        for r in readers.get(unit, []):
            if not hb.before((1, c), (1, r)):
                problems.append(f"{at(r, instrs[r])} may run before {at(c, ins)} completes (missing wait)")
        s = store.get(unit)
        if s is not None:
            if not hb.before((1, c), (1, s)):
                problems.append(f"{at(s, instrs[s])} may run before {at(c, ins)} completes (missing wait)")
            if instrs[s].shard != (ins.op == "reduce_scatter"):
                problems.append(f"{at(s, instrs[s])} must {'' if ins.op == 'reduce_scatter' else 'not '}store a "
                                f"shard after {ins.op}")
    for unit, idx in grads.items():
        if unit not in bwd:
            problems.append(f"{at(idx[0], instrs[idx[0]])} without a backward of {unit}")
    return problems


def _latest(positions: list[int], i: int) -> tuple[int, int] | None:
    """The latest of `positions` before i as (copy, index), wrapping to the previous step (copy 0)."""
    prev = [p for p in positions if p < i]
    if prev:
        return 1, prev[-1]
    return (0, positions[-1]) if positions else None

