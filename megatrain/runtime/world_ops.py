"""The engine's collectives: the comm-stream ops of a world program (planner/world.py, planner/collectives.py).

Where it sits: a mixin of the Engine (engine.py), calling the Communicator (distributed.py). Every rank runs the
same program, so each rank's comm stream issues the same collectives in the same order. A sharded unit's slot
is completed in place by `all_gather` (rank r's shard is elements [r S, (r+1) S) of the padded flat buffer);
its final gradients are summed by `reduce_scatter`, which leaves the rank's summed shard in place and writes
that shard's per-parameter norms after the gradients; a replicated unit's by `all_reduce`. Both gradient
collectives also gather every rank's routing records (MoE), which store_grads then hands over.
"""

from __future__ import annotations

import torch


class WorldOps:
    """all_gather, reduce_scatter, all_reduce (needs the engine's `units`, `store`, `bufs`, `comm`, `rank`)."""

    def all_gather(self, i: int, unit: str, slot: int) -> None:
        u = self.units[unit]

        def run():
            self.comm.all_gather_shards(self.bufs[f"slot{slot}"][: u.flat_numel], f"all_gather({unit})")

        self._submit("comm", i, f"all_gather({unit}, slot={slot})", run)

    def reduce_scatter(self, i: int, unit: str, grad_slot: int) -> None:
        u, st, logs, gathered = self.units[unit], self.store.units[unit], self.routing_logs, self.gathered_routing

        def run():
            flat = self.bufs[f"grad{grad_slot}"]
            self.comm.reduce_scatter_shards(flat[: u.flat_numel], f"reduce_scatter({unit})")
            lo = self.rank * st.unit.flat_numel
            pieces = [flat[lo + p.offset : lo + p.offset + p.numel] for p in st.unit.params]  # the shard's slices
            if pieces:  # their L2 norms, as _write_norms takes a whole unit's
                torch.stack(torch._foreach_norm(pieces, 2.0), out=flat[u.flat_numel : u.flat_numel + len(pieces)])
            self._gather_routing(u, logs, gathered)

        self._submit("comm", i, f"reduce_scatter({unit}, grad_slot={grad_slot})", run)

    def all_reduce(self, i: int, unit: str, grad_slot: int) -> None:
        u, logs, gathered = self.units[unit], self.routing_logs, self.gathered_routing

        def run():
            self.comm.all_reduce(self.bufs[f"grad{grad_slot}"][: u.flat_numel], f"all_reduce({unit})")
            self._write_norms(u, grad_slot)
            self._gather_routing(u, logs, gathered)

        self._submit("comm", i, f"all_reduce({unit}, grad_slot={grad_slot})", run)
