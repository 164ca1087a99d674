"""MoE routing state across a step: the routing logs the engine keeps, and the buffers' update the store runs.

Where it sits: the Engine (engine.py) mixes in `RoutingLogs`; the host store (store.py) calls `update_unit_buffers`
at a unit's optimizer step. Units with buffers (MoE routing state, models/routing.py) run every step's forward in
a routing step context: the forward records the step's routing statistics in a RoutingLog per (unit,
micro-batch), and the experts' row counts (on the device); a backward's recompute checks on the device that it
routes as the forward did (the buffers change only at the optimizer step, so it does), reads nothing back, and
records nothing. store_grads hands the unit's logs to the host store with its gradients (in a world: every
rank's, which the gradient collective gathered), and the store's optimizer step updates the buffers from them,
as the eager reference does after optimizer.step().
"""

from __future__ import annotations

from megatrain.ir.layout import buffer_views
from megatrain.ir.model_ir import UnitIR
from megatrain.models import routing
from megatrain.models.moe import update_buffers


class RoutingLogs:
    """The engine's routing logs (needs `config`, `device`, `comm`, `store`)."""

    routing_logs: dict[str, dict[int, routing.RoutingLog]]  # this step's, by unit and micro-batch
    gathered_routing: dict[str, list]  # every rank's records of a unit, global order (a world)

    def _forward_context(self, logs: dict, unit: str, mb: int, scale: float):
        """A step's forward of `unit` on `mb`: route, record into its log, add the aux loss scaled by `scale`."""
        return routing.step_context(logs.setdefault(unit, {}).setdefault(mb, routing.RoutingLog()), scale)

    def _recompute_context(self, unit: str, mb: int, scale: float):
        """A backward's recompute: route as the forward did (checked against its row counts), record nothing."""
        routed = self.routing_logs.get(unit, {}).get(mb)
        return routing.step_context(None, scale, replay=routed.counts if routed else None)

    def routing_metrics(self) -> dict:
        """The last step's routing metrics (routing.summarize); {} for a model without MoE layers. In a world:
        this rank's micro-batches (the buffers' update reads every rank's)."""
        moe = self.config.moe
        if moe is None:
            return {}
        logs = {unit: [by_mb[mb].records for mb in sorted(by_mb)] for unit, by_mb in self.routing_logs.items()}
        return routing.summarize(logs, moe.top_k)

    def _gather_routing(self, u: UnitIR, logs: dict, gathered: dict) -> None:
        """Every rank's routing records of `u` into `gathered` (its forwards are done: its backward preceded
        this). NOTE: `logs` and `gathered` are the step's, bound when the op was issued: the next begin()
        replaces them while this stream may still be behind."""
        if u.buffers:
            by_mb = logs.get(u.name, {})
            gathered[u.name] = self.comm.gather_records([by_mb[mb].records for mb in sorted(by_mb)])

    def _hand_routing(self, u: UnitIR, logs: dict, gathered: dict) -> None:
        """store_grads of a unit with buffers: the statistics its buffers' update needs travel with its gradients
        (on the d2h stream, after its forwards)."""
        if u.name in gathered:
            self.store.put_routing(u.name, [[{k: v.to("cpu") for k, v in r.items()} for r in mb]
                                            for mb in gathered[u.name]])
        else:
            by_mb = logs.get(u.name, {})
            self.store.put_routing(u.name, [by_mb[mb].to_host(self.device.to_host) for mb in sorted(by_mb)])


def update_unit_buffers(template, st) -> None:
    """A unit's optimizer step, after its AdamW update: its buffers from the step's routing records (the
    unit's store state `st`), which are then dropped."""
    update_buffers(template, buffer_views(st.buffers, st.unit.buffers), st.routing or [])
    st.routing = None
