"""The world: how many ranks train together, on how many nodes, and how each rank's share of the model state
is laid out. Data parallelism across GPUs and nodes (docs/DESIGN.md 7).

Where it sits: `plan(..., world=World(nproc=R, nnodes=N))` plans one rank's step of an R-rank run; the
`collectives` pass (collectives.py) lowers the world into collective ops of the Program; the runtime's sharded
store (runtime/sharded_store.py) allocates the layout `rank_ir` describes, and the plan counts the same
buffers, so per-rank host bytes agree to the byte. Try it:
`python -c "from megatrain.planner.world import World; print(World(nproc=8, nnodes=2))"`.

The batch: the TrainSpec describes the *global* step (grad_accum micro-batches of micro_batch sequences); each
rank runs grad_accum / R of them (rank r the r-th contiguous group), so R-rank training over the global batch
is 1-rank training over it, and a checkpoint resumes at any R that divides grad_accum.

The layout of a unit's state across ranks:
- every unit's flat buffer is padded to a multiple of R x SHARD_ALIGN elements (`world_ir`), so the R shards
  are equal, contiguous, and each starts 64-byte aligned (bf16); rank r's shard is elements [r S, (r+1) S) of
  the padded flat buffer, S = padded / R. The padding holds no parameter: nothing reads it.
- a sharded unit's host state on rank r is its shard: the master, both moments and the gradient buffer hold S
  elements; the parameters intersecting the shard become its *slices* (at most one per parameter: the shard is
  contiguous), each with its own AdamW step count and weight-decay group (its parameter's), and, under the fp8
  policy, its own quantisation blocks (they start at each slice's first element, so fp8 at R > 1 is not fp8 at
  R = 1 where a slice does not start on a block boundary of its parameter).
- a unit that holds or owns a tied parameter (the LM head sharing the embedding) is *replicated*: every rank
  holds its whole state, its gradient is all-reduced and every rank steps it identically (same values in, same
  kernel: the replicas stay bit-identical). Its shards would not line up with its tie partner's (other offsets),
  and only tied models have such units. The plan counts their whole state on every rank.
- unit buffers (MoE routing state) are replicated too: small, and updated from every rank's routing records.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from megatrain.ir.base import IRModel
from megatrain.ir.model_ir import ModelIR, ParamSlice, UnitIR

SHARD_ALIGN = 32  # elements: each shard starts 64-byte aligned in bf16 (ir/layout.py ALIGN)
MAX_NPROC = 65536


class World(IRModel):
    """R ranks (one GPU each) on N nodes of R / N ranks each."""

    nproc: int = Field(1, ge=1, le=MAX_NPROC, description="ranks (GPUs) in all, across every node")
    nnodes: int = Field(1, ge=1, le=MAX_NPROC, description="nodes (machines); each runs nproc / nnodes ranks")

    @model_validator(mode="after")
    def _divides(self) -> World:
        if self.nproc % self.nnodes:
            raise ValueError(f"--nproc {self.nproc} is not a multiple of --nnodes {self.nnodes}: every node runs "
                             "the same number of ranks (nproc / nnodes GPUs each)")
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.nproc // self.nnodes

    def local_micro_batches(self, grad_accum: int) -> int:
        """Micro-batches each rank runs per step (grad_accum / nproc); one line naming the fix otherwise."""
        if grad_accum % self.nproc:
            raise ValueError(f"--grad-accum {grad_accum} is not a multiple of --nproc {self.nproc}: the global step's "
                             f"micro-batches are split evenly across ranks (each runs grad_accum / nproc); use "
                             f"--grad-accum {self.nproc * max(1, -(-grad_accum // self.nproc))}, or a number of "
                             f"ranks that divides {grad_accum} ({', '.join(str(k) for k in range(1, grad_accum + 1) if grad_accum % k == 0)}"
                             "; a resumed run keeps its checkpoint's --grad-accum)")
        return grad_accum // self.nproc

    def __str__(self) -> str:
        return (f"{self.nproc} rank(s) on {self.nnodes} node(s)" if self.nnodes > 1 else f"{self.nproc} rank(s) on "
                "1 node")


def padded_numel(numel: int, nproc: int) -> int:
    """Elements of a flat buffer of `numel` padded so `nproc` aligned shards split it evenly."""
    step = nproc * SHARD_ALIGN
    return -(-numel // step) * step if nproc > 1 else numel


def world_ir(ir: ModelIR, nproc: int) -> ModelIR:
    """The IR one rank's device sees: every unit's flat buffer padded (padded_numel); nothing else changes (the
    parameters keep their offsets, the padding is at the end). The IR itself for one rank."""
    if nproc == 1:
        return ir
    units = tuple(u.replace(flat_numel=padded_numel(u.flat_numel, nproc)) for u in ir.units)
    return ir.replace(units=units)


def replicated_units(ir: ModelIR) -> frozenset[str]:
    """Units whose state every rank holds whole: those holding a tied parameter and those owning one."""
    names = [u.name for u in ir.units]
    out = set()
    for u in ir.units:
        for ref in u.tied.values():
            out.add(u.name)
            out.add(max((n for n in names if ref.startswith(n + ".")), key=len))
    return frozenset(out)


def shard_elems(unit: UnitIR, nproc: int) -> int:
    """S: elements of one rank's shard of a (padded) unit."""
    if unit.flat_numel % nproc:
        raise ValueError(f"unit {unit.name}: {unit.flat_numel} elements do not split into {nproc} shards; pad it "
                         "first (world_ir)")
    return unit.flat_numel // nproc


def shard_slices(unit: UnitIR, nproc: int, rank: int) -> tuple[ParamSlice, ...]:
    """The slices of rank `rank`'s shard of a padded unit: per parameter intersecting the shard, its piece, named
    as the parameter, shaped flat, at its offset inside the shard. `slice_start` maps one back to its parameter."""
    S = shard_elems(unit, nproc)
    lo, hi = rank * S, (rank + 1) * S
    out = []
    for p in unit.params:
        a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
        if a < b:
            out.append(ParamSlice(name=p.name, shape=(b - a,), offset=a - lo, numel=b - a))
    return tuple(out)


def slice_start(unit: UnitIR, nproc: int, rank: int, piece: ParamSlice) -> int:
    """Where in its parameter (flat elements) a slice of rank `rank`'s shard starts."""
    p = next(q for q in unit.params if q.name == piece.name)
    return rank * shard_elems(unit, nproc) + piece.offset - p.offset


def rank_ir(ir: ModelIR, nproc: int, rank: int) -> ModelIR:
    """The host's view on rank `rank` of a padded IR (world_ir): a sharded unit becomes its shard (flat_numel
    S, its slices as parameters); a replicated unit stays whole. What the sharded store allocates and the plan
    counts (host_policy.host_layout of it)."""
    if nproc == 1:
        return ir
    if not 0 <= rank < nproc:
        raise ValueError(f"rank {rank} is outside a world of {nproc} ranks")
    whole = replicated_units(ir)
    units = tuple(u if u.name in whole else
                  u.replace(params=shard_slices(u, nproc, rank), flat_numel=shard_elems(u, nproc))
                  for u in ir.units)
    return ir.replace(units=units)
