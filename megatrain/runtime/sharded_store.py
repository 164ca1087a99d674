"""The sharded host store: one rank's share of the model state in a data-parallel world.

Where it sits: the Trainer builds it instead of HostStore when it runs under torchrun (distributed.py); the
engine's world ops (load_params(shard=True), store_grads(shard=True), reduce_scatter) read and write it; the
sharded checkpoints (sharded_checkpoint.py) save and load it. Layout: planner/world.py. It *is* a HostStore
over the rank's view of the model (world.rank_ir): a sharded unit is its shard of S elements whose parameters
are the shard's slices, so allocation, loads, stores, the optimizer step (AdamW is elementwise: a slice's step
is its elements' part of the whole step), the tied-parameter logic of replicated units and the host-byte count
(equal to the plan's per-rank bytes) are the HostStore's own.

What differs:
- a slice takes its parameter's weight-decay group (slices are flat) and its part of the initial weights;
- the clip norm: clip_grad_norm_'s norm is sqrt(sum over parameters of |g_p|^2); each rank knows the norms of
  its slices (the reduce_scatter wrote them) and of its replicated units, so the global norm is
  sqrt(all-reduce(sum of the squared slice norms) + the replicated units' squared norms), summed in fp64. It
  equals clip_grad_norm_'s to fp32 round-off, not bit for bit: torch sums the squares of whole parameters'
  norms in fp32 in parameter order, this sums the squares of slices' norms in another order;
- the barrier's fault verdict (a non-finite loss, an update that could overflow) is agreed across ranks, so
  every rank skips or keeps a step alike (`--on-nan skip`); a non-finite gradient shows in the global norm.
"""

from __future__ import annotations

import math

import torch

from megatrain.ir.layout import buffer_views
from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Program
from megatrain.models import decays, init_into
from megatrain.models.eager import param_shapes
from megatrain.planner.host_policy import HostPolicy
from megatrain.planner.train import TrainSpec
from megatrain.planner.world import rank_ir, replicated_units, slice_start

from . import host_init
from .store import HostStore


class ShardedHostStore(HostStore):
    """Rank `comm.rank`'s share of the state of a padded world IR (`plan.ir` of a world plan)."""

    def __init__(self, ir: ModelIR, optim: TrainSpec, seed: int = 0, *, policy: HostPolicy | str = "exact",
                 program: Program, comm, device: str = "sim", init: bool = True) -> None:
        if program.world_size != comm.size:
            raise ValueError(f"the program is one rank's of {program.world_size}, the communicator has {comm.size}")
        self.full_ir, self.comm = ir, comm
        self.world_size, self.rank = comm.size, comm.rank
        self.sharded = frozenset(u.name for u in ir.units) - replicated_units(ir)
        super().__init__(rank_ir(ir, comm.size, comm.rank), optim, seed, policy=policy, program=program,
                         device=device, init=False)
        for name in self.sharded:
            st, shapes = self.units[name], {p.name: p.shape for p in ir.unit(name).params}
            st.decay = [decays(f"{name}.{p.name}", shapes[p.name]) for p in st.owned]
            for mom, p in zip(st.moments, st.owned):  # bf16 moments round by the index in the whole parameter
                mom.origin = self.start(name, p)
        if init:
            self._init(seed)

    def start(self, unit: str, piece) -> int:
        """Where a piece of `unit`'s store layout starts in its parameter (0 for a whole unit's parameter)."""
        if unit not in self.sharded:
            return 0
        return slice_start(self.full_ir.unit(unit), self.world_size, self.rank, piece)

    def _init(self, seed: int) -> None:
        shapes = param_shapes(self.config)
        for st in self.units.values():  # each unit's whole tensors drawn in parallel, then this rank's slices
            names = [f"{st.unit.name}.{p.name}" for p in st.owned]
            weights = {n: torch.empty(shapes[n]) for n in names}
            init_into(self.config, seed, {n: t.view(-1) for n, t in weights.items()})
            for p, v, name in zip(st.owned, st.master_views(), names):
                a = self.start(st.unit.name, p)
                host_init.copy(v, weights[name].reshape(-1)[a : a + p.numel])

    def load_state(self, weights: dict[str, torch.Tensor]) -> None:
        """Set this rank's part of the masters from eager-named whole fp32 tensors (any subset of them)."""
        self._invalidate()
        for st in self.units.values():
            for p, v in zip(st.owned, st.master_views()):
                w = weights.get(f"{st.unit.name}.{p.name}")
                if w is not None:
                    a = self.start(st.unit.name, p)
                    v.copy_(w.reshape(-1)[a : a + p.numel])

    def named_master(self) -> dict[str, torch.Tensor]:
        raise ValueError("a sharded store holds slices of its parameters: use full_master() (on every rank) for "
                         "whole tensors")

    def shard_state(self, unit: str, mirror: bool = True) -> dict[str, torch.Tensor]:
        """A sharded unit's state on this rank as flat views of the store's memory, by checkpoint name:
        `master`, `exp_avg`, `exp_avg_sq` (S elements; the policy's moment dtype), `exp_avg_scale`,
        `exp_avg_sq_scale` (fp8: per block of each slice), `step` (one count per slice), `buffer` (its routing
        buffers, replicated). Read them to save; write into them to load. `mirror=False`: as state_tensors'."""
        st = self.units[unit]
        st.bound = None
        if mirror:  # a device unit's shard: its mirror brought up to date, uploaded again before the next step
            self._mirror_touch()
        self.feed.invalidate(unit)  # a bf16 copy of the masters (runtime/cast.py) is cast again at its next load
        return self.shard_views(unit)

    def shard_views(self, unit: str) -> dict[str, torch.Tensor]:
        """`shard_state`'s views with no side effect, for a reader that writes nothing (HostStore.state_views)."""
        st, b = self.units[unit], self._bufs
        out = {"master": st.master, "exp_avg": b[f"exp_avg.{unit}"], "exp_avg_sq": b[f"exp_avg_sq.{unit}"]}
        if f"scales.{unit}" in b:
            scales = b[f"scales.{unit}"]
            half = scales.numel() // 2
            out["exp_avg_scale"], out["exp_avg_sq_scale"] = scales[:half], scales[half:]
        out["step"] = b[f"steps.{unit}"]
        if st.unit.buffers:
            out["buffer"] = st.buffers
        return out

    def full_master(self) -> dict[str, torch.Tensor]:
        """Every owned parameter's whole fp32 master by eager name, gathered from every rank (a collective on
        the main group: call it on every rank, between steps)."""
        if self.mirror is not None:  # device units' shards: their mirror brought up to date (read only)
            self.mirror.pull()
        out = {}
        for u in self.full_ir.units:
            st = self.units[u.name]
            if u.name in self.sharded:
                flat = torch.empty(u.flat_numel, dtype=torch.float32)
                S = st.unit.flat_numel
                flat[self.rank * S : (self.rank + 1) * S].copy_(st.master)
                self.comm.all_gather_shards(flat, f"gather the masters of {u.name}", group="main")
                for p in u.params:
                    if p.name not in u.tied:
                        out[f"{u.name}.{p.name}"] = flat[p.offset : p.offset + p.numel].view(p.shape)
            else:  # replicated: the whole unit is here, in its host layout
                for p, v in zip(st.owned, st.master_views()):
                    out[f"{u.name}.{p.name}"] = v.clone().view(p.shape)
        return out

    def state_tensors(self, unit: str, mirror: bool = True) -> dict[str, torch.Tensor]:
        """HostStore's, for a replicated unit (rank 0 alone reads them to save): a device unit is never
        replicated, and a touch on one rank only would make it alone upload and gather (resident.py)."""
        return super().state_tensors(unit, mirror=mirror and unit in self.sharded)

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """Eager-named views of every unit's buffers (replicated: this rank's are everyone's)."""
        return {f"{st.unit.name}.{n}": v for st in self.units.values()
                for n, v in buffer_views(st.buffers, st.unit.buffers).items()}

    # -- the barrier across ranks --------------------------------------------------------------------------------
    def _global_norm(self, norms: list[torch.Tensor]) -> torch.Tensor:
        mine = 0.0
        whole = 0.0
        for st in self.units.values():
            own = self._norms(st)
            if not own:
                continue
            sq = float(torch.stack(own).double().square().sum())
            if st.unit.name in self.sharded:
                mine += sq
            else:
                whole += sq
        total = self.comm.sum([mine], group="host", what="clip_grads' squared norms")[0] + whole
        return torch.tensor(math.sqrt(total) if total >= 0 else float("nan"), dtype=torch.float32)

    def _agree(self, fault: str | None) -> str | None:
        found = self.comm.gather_objects(fault, group="host", what="clip_grads' fault verdict")
        for r, what in enumerate(found):
            if what is not None:
                return what if r == self.rank else f"{what} (found by rank {r})"
        return None
