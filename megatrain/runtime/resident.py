"""Units whose state lives on the device (issue 40): their optimizer state, uploaded once, stepped on the device.

Where it sits: an Engine mixin (engine.py). The plan says per unit where its state lives (ir/program.py
`resident_units`): a "weights" unit only keeps its parameter slot, which the runtime treats like any slot; a
"device" unit also has `dstate.{unit}` (planner/residency.py `device_state_layout`: fp32 master unless the compute
dtype is fp32, where the slot is the master; both AdamW moments; the step counts), and the program steps it with
`device_step` on the compute stream and lands its gradient norms on the host with `store_norms`.

The host store keeps every unit's master and moments (store.py); for a device unit they are its mirror: the
checkpoint and export read it. The engine keeps the two consistent without a sync inside a step:
- `upload_resident()` copies the mirror to the device (master, moments, step counts, and the slot: the master
  cast to the compute dtype, torch's rounding, as the host cast). It runs at construction and again at the next
  `begin()` whenever the mirror was written through the store (load_state, a checkpoint's load, named_master),
  which the store reports through `HostStore.mirror` (its hook to this mixin).
- `download_resident()` copies the device state into the mirror (on the compute stream, then synchronised):
  the store calls it before anything reads its state tensors after a step ran (a checkpoint save, an export,
  named_master), so every reader of the host store sees the device's state.
- `pull_unit_state(unit)` copies one unit's state into its mirror on the calling stream, for a caller ordering
  it with events itself (issue 41's streamed checkpoint writes).

The step (`device_step`): host_adamw.device_adamw, the host's exact-policy AdamW as torch ops on the device
tensors (on the sim device the same kernel as the host's step, so the same bits). With a clip_grads barrier it
reads the host's clip factor (the program makes the compute stream wait for clip_grads), and a step the
barrier's verdict found faulty is skipped (the host's verdict, read on the issuing thread: no device sync).
Without a barrier and with fault checks on (--on-nan), the unit's own norms decide on the device: a flag that
makes the fused kernel leave master, moments and step counts as they were, so a non-finite gradient never
reaches the device master; the host reads the flags at `end()` (which synchronises the compute stream anyway)
and records the fault as the host's own step would have. The overflow screen of verdict.py (a bound on the
weights the host keeps per unit) is not kept for device units.

In a data-parallel world (planner/world.py) the store's unit is the rank's shard and so is `dstate.{unit}`:
the step updates elements [r S, (r+1) S) of the unit's padded flat buffer from the reduce-scattered shard of
its gradient slot and writes them into the slot's shard; the program's all_gather after device_step makes the
slot whole, and an upload gathers it too (every rank uploads at the same points: the store touches the mirror
only through reads every rank makes alike, sharded_store.py).
"""

from __future__ import annotations

import torch

from megatrain.ir.program import resident_units
from megatrain.planner.residency import device_state_layout

from .host_adamw import DTYPES, Moments, device_adamw


class DeviceState:
    """One device unit's tensors in `dstate.{unit}` and its slot, as views the step and the copies take."""

    def __init__(self, engine, unit: str, slot: int, nbytes: int):
        st, dev = engine.store.units[unit], engine.device
        self.unit, self.slot_index = unit, slot
        self.tensors = {name: dev.empty((n,), DTYPES[dt]) for name, dt, n in
                        device_state_layout(st.unit, engine.store.policy, engine.ir.dtype)}
        got = sum(t.numel() * t.element_size() for t in self.tensors.values())
        # in a world the plan counts the most any rank holds (the ranks' shards cut their parameters into
        # different numbers of slices, each with its step count)
        if got != nbytes and not (engine.program.world_size > 1 and got < nbytes):
            raise ValueError(f"dstate.{unit} holds {got} bytes, the plan counts {nbytes}: plan again with this "
                             "megatrain (planner/residency.py device_state_bytes)")
        # in a world the store's unit is the rank's shard of the padded unit (world.py): its elements
        # [lo, lo + S) of the slot are the ones this rank steps; all_gather brings the others' after each step
        self.whole_slot = engine.bufs[f"slot{slot}"][: engine.units[unit].flat_numel]
        self.lo = engine.rank * st.unit.flat_numel if engine.program.world_size > 1 else 0
        self.slot = self.whole_slot[self.lo : self.lo + st.unit.flat_numel]
        self.master = self.tensors.get("master", self.slot)  # an fp32 unit's slot is its master
        self.params = [self.master[p.offset : p.offset + p.numel] for p in st.host]
        m, v = self.tensors["exp_avg"], self.tensors["exp_avg_sq"]
        self.moments = [Moments(m[p.offset : p.offset + p.numel], v[p.offset : p.offset + p.numel]) for p in st.host]
        self.steps = [self.tensors["steps"][j] for j in range(len(st.owned))]

    def pairs(self, store) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor, its host mirror) of everything the unit's state holds."""
        b = store._bufs
        return [(self.master, b[f"master.{self.unit}"][: self.master.numel()]),
                (self.tensors["exp_avg"], b[f"exp_avg.{self.unit}"]),
                (self.tensors["exp_avg_sq"], b[f"exp_avg_sq.{self.unit}"]),
                (self.tensors["steps"], b[f"steps.{self.unit}"])]


class Resident:
    """The Engine's handling of units whose state lives on the device (module docstring)."""

    def _init_resident(self) -> None:
        self.state_place = resident_units(self.program)
        self.dstate: dict[str, DeviceState] = {}
        self._found: dict[str, torch.Tensor] = {}  # this step's device fault flags (no barrier, --on-nan)
        self._mirror_stale = False  # the store's mirror was written: upload before the next step
        self._device_newer = False  # a step ran since the last download
        slots = {ins.unit: (ins.slot, ins.grad_slot) for ins in self.program.instrs if ins.op == "device_step"}
        if not slots:
            return
        for unit, (slot, _) in slots.items():
            self.dstate[unit] = DeviceState(self, unit, slot, self.program.buffer(f"dstate.{unit}").nbytes)
        self.store.mirror = self
        self.upload_resident()

    # -- the store's hook ------------------------------------------------------------------------------------
    def pull(self) -> None:
        """The store is about to be read: bring the mirror up to date (HostStore.mirror)."""
        if self._device_newer:
            self.download_resident()

    def stale(self) -> None:
        """The store's state may have been written: upload it before the next step (HostStore.mirror)."""
        self._mirror_stale = True

    def _begin_resident(self) -> None:
        if self.dstate:
            if self._mirror_stale:
                self.upload_resident()
            self._device_newer = True
            self._found = {}

    # -- copies ----------------------------------------------------------------------------------------------
    def upload_resident(self) -> None:
        """Every device unit's state from the host store's mirror onto the device, and its slot's weights."""
        def run():
            for ds in self.dstate.values():
                for dev, host in ds.pairs(self.store):
                    self.device.copy(dev, host)
                if ds.master is not ds.slot:
                    ds.slot.copy_(ds.master)  # the compute dtype's rounding of the master, torch's

        self._drained("compute", run, "upload_resident()")
        if self.program.world_size > 1:  # each rank uploaded its shard of the weights: gather the others'
            self._gather_resident()
        self._mirror_stale = False

    def _gather_resident(self) -> None:
        """Every device unit's slot made whole from the ranks' shards, on the comm stream (its group's order:
        every rank uploads at the same point, between steps)."""
        def run():
            for ds in self.dstate.values():
                self.comm.all_gather_shards(ds.whole_slot, f"all_gather({ds.unit}) after its upload")

        self._drained("comm", run, "upload_resident() all_gather")

    def download_resident(self) -> None:
        """Every device unit's state into the host store's mirror (the device's compute stream drained)."""
        def run():
            for unit in self.dstate:
                self.pull_unit_state(unit)

        self._drained("compute", run, "download_resident()")
        self._device_newer = False

    def _drained(self, stream: str, fn, label: str) -> None:
        """`fn` in `stream`'s order, then that stream drained; on a closed device (its streams have ended: what a
        test reads after the run) on this thread, between device synchronisations."""
        if not self.device.closed:
            self.device.submit(stream, fn, label)
            self.device.synchronize(stream)
            return
        if self.device.kind == "cuda":
            torch.cuda.synchronize(self.device.torch_device)
        fn()
        if self.device.kind == "cuda":
            torch.cuda.synchronize(self.device.torch_device)

    def pull_unit_state(self, unit: str) -> None:
        """One device unit's state into its host mirror, on the calling stream (call it from a submitted fn)."""
        for dev, host in self.dstate[unit].pairs(self.store):
            self.device.copy(host, dev)

    # -- the ops ---------------------------------------------------------------------------------------------
    def _step_resident(self, unit: str, grad_slot: int, lr: float, step: int) -> None:
        store, ds = self.store, self.dstate[unit]
        st = store.units[unit]
        if store.check_finite and (store._fault_step == step or (store.stop_on_fault and store._fault_step is not None)):
            return  # the barrier found the step faulty (or --on-nan abort after a fault): as the host's units
        u = self.units[unit]  # the plan's (padded) unit: its norms follow its whole gradient
        flat = self.bufs[f"grad{grad_slot}"]
        found = None
        if store.check_finite and not self._clips:  # no barrier: the unit's own norms decide, on the device
            norms = flat[u.flat_numel : u.flat_numel + len(st.unit.params)]
            found = torch.isfinite(norms).all().logical_not().to(torch.float32)
            self._found[unit] = found
        lo = ds.lo  # a world's reduce_scatter left the rank's summed shard in place
        grads = [flat[lo + p.offset : lo + p.offset + p.numel] for p in st.owned]
        device_adamw(store.policy, ds.params, grads, ds.moments, ds.steps, store.optim, lr, st.decay,
                     store.clip_coef if self._clips else None, found)
        if ds.master is not ds.slot:
            ds.slot.copy_(ds.master)

    def _land_norms(self, unit: str, grad_slot: int) -> None:
        u, st = self.units[unit], self.store.units[unit]
        self.device.copy(st.norms, self.bufs[f"grad{grad_slot}"][u.flat_numel : u.flat_numel + len(st.norms)])

    def _end_resident(self, step: int) -> None:
        """After the step's compute drained: record the device units' faults as the host's steps would."""
        if not self._found:
            return
        names = list(self._found)
        flags = torch.stack([self._found[n] for n in names]).tolist()
        self._found = {}
        for name, bad in zip(names, flags):
            if bad:
                self.store._fault(step, f"the gradients of {name} are not finite")
