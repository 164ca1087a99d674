"""The engine: executes a step program's instructions on a device, making no decisions of its own.

Where it sits: codegen (codegen/) turns a Plan's Program into `step(rt, batch)`, a straight-line Python
function calling one method of this class per instruction; each method submits a closure to its stream on
the device (device.py), so the calls return at once and the streams run concurrently, ordered only by the
program's record/wait events. Errors inside a stream name the instruction that failed.

How a unit runs (unit_runner.py: bound to views of its slot): a forward runs without autograd and keeps the
unit's carry-in as its checkpoint; a backward recomputes the unit from that checkpoint with autograd,
back-propagates with torch.autograd.grad, and writes the parameter gradients into a fp32 gradient slot
(adding across micro-batches).

The instruction says what to do, the engine translates it: a forward's `mode` and a backward's `source`
(ir/program.py) become the unit's keyword modes (models/) and the buffers kept between them (`saved`, `side`,
`attn`). Host memory is the store's (store.py): load_params asks it to feed the slot, store_grads lands
gradients in the program's host gradient buffer (`host_grad`) with the per-parameter norms a
`backward(norm=True)` wrote after them in the gradient slot, and checkpoints go to its pinned copies.

Mixed in from modules of their own: running a unit (unit_runner.py), span tracing (spans.py), MoE routing logs (moe_logs.py: load_params copies a
unit's buffers into the slot after the weights, its step's forwards log their routing, store_grads hands the
logs to the store), a world program's collectives (world_ops.py: `begin` keeps this rank's group of the global
step's micro-batches, `end` sums the loss across ranks, `shard` moves this rank's shard of a unit) and the
evaluation program's entry and exit (evaluation.py) and a checkpointing step's writes on the disk stream
(checkpoint_stream.py: save_state, seal_checkpoint).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from megatrain.ir.layout import slot_buffers
from megatrain.ir.model_ir import ModelIR, UnitIR
from megatrain.ir.program import STAGING_BYTES, Program, checkpoint_tensors
from megatrain.ir.trace import DTYPES
from megatrain.models import (
    ModelConfig,
    packing,
    rope_tables,
    run_unit,
    templates,
)
from megatrain.models.loss import IGNORE_INDEX
from megatrain.models.replay import Record, record_attention

from .checkpoint_stream import CheckpointStream
from .compiled import runners
from .distributed import local_batch
from .evaluation import Evaluation
from .moe_logs import RoutingLogs
from .resident import Resident
from .spans import Spans
from .staging import Staging
from .store import HostStore
from .stream_device import Device
from .unit_runner import UnitRunner
from .world_ops import WorldOps

__all__ = ["Engine"]


class Engine(UnitRunner, Spans, RoutingLogs, WorldOps, Evaluation, CheckpointStream, Resident):
    """The `rt` of a generated step program (and of an evaluation program)."""

    def __init__(self, ir: ModelIR, program: Program, device: Device, store: HostStore, loss_chunk: int = 1024,
                 comm=None, compile_units: bool = False):
        if store.program is not program:
            raise ValueError("the host store was built for another program: HostStore(..., program=program)")
        if program.world_size != (comm.size if comm is not None else 1):
            raise ValueError(f"the step program is one rank's of {program.world_size}, but this engine runs on "
                             f"{comm.size if comm is not None else 1} rank(s): launch one process per rank "
                             "(torchrun --nproc-per-node) and pass the Communicator")
        self.comm, self.rank = comm, comm.rank if comm is not None else 0
        self.ir, self.program, self.device, self.store = ir, program, device, store
        self.config = ModelConfig.model_validate(ir.config)
        self.dtype = DTYPES[ir.dtype]
        self.loss_chunk = loss_chunk
        self.templates = templates(self.config)
        self.runners = runners(self.config, self.templates, compile_units)  # compiled.py: eager by default
        self.units: dict[str, UnitIR] = {u.name: u for u in ir.units}
        names = [u.name for u in ir.units]
        self.next_unit = dict(zip(names, names[1:]))
        self.bufs: dict[str, object] = {}
        # (unit, mb) -> the attention record of a replaying forward (its kept tensors are the `attn` buffer)
        self.records: dict[tuple[str, int], Record | None] = {}
        self.unreplayed: set[str] = set()  # units whose device kernel was not the one traced (_kept)
        self.step_index = 0
        self.lr = 0.0
        self.losses: list[torch.Tensor] = []
        self.n_tokens = 0
        self.routing_logs = {}  # this step's routing logs by unit and micro-batch (moe_logs.py)
        self.gathered_routing: dict[str, list] = {}  # every rank's records of a unit, global order (a world)
        self._eval_modules = {}  # evaluation programs by batch count (evaluation.py)
        self.finals: dict[int, float] = {}  # engine step -> perf_counter time its state was final
        self.staging = Staging(device, STAGING_BYTES, store.checkpoint_staging)  # long checkpoints' copies
        self._clips = any(i.op == "clip_grads" for i in program.instrs)
        self._allocate_static()
        self._init_resident()  # units whose state lives on the device: uploaded from the store (resident.py)

    # -- static buffers -----------------------------------------------------------------------------------
    def _allocate_static(self) -> None:
        dev = self.device
        for b in self.program.buffers:
            if not b.static:
                continue
            dev.pool.alloc(b.name, b.nbytes)
            if b.kind == "param_slot":
                self.bufs[b.name] = dev.empty((b.nbytes // self.dtype.itemsize,), self.dtype)
            elif b.kind == "grad_slot":
                self.bufs[b.name] = dev.empty((b.nbytes // 4,), torch.float32)
            elif b.kind == "cast_stage":  # the "gpu" cast's fp32 landing buffer (runtime/cast.py)
                self.bufs[b.name] = dev.empty((b.nbytes // 4,), torch.float32)
                self.store.feed.bind(self.bufs[b.name])
        cos, sin = rope_tables(self.config, self.ir.seq_len, self.dtype)
        self.bufs["rope"] = (cos.to(dev.torch_device), sin.to(dev.torch_device))
        dev.synchronize()  # NOTE: the copies above ran on the caller's stream; the device's streams must see them

    # -- step entry and exit --------------------------------------------------------------------------------
    def begin(self, batch: list[tuple[torch.Tensor, ...]], lr: float) -> None:
        """Place the step's micro-batches on the device; the head scales gradients by 1/tokens. A micro-batch
        is (tokens, targets), or (tokens, targets, positions) when it packs several documents per row."""
        if len(batch) != self.program.n_micro_batches * self.program.world_size:
            raise ValueError(f"the step program takes {self.program.n_micro_batches} micro-batches, got {len(batch)}")
        packed = {len(mb) == 3 for mb in batch}
        if packed != {self.ir.packed}:
            raise ValueError(f"the step program was traced for {'packed' if self.ir.packed else 'unpacked'} "
                             f"micro-batches, got {'a mix' if len(packed) > 1 else 'packed' if True in packed else 'unpacked'}"
                             " ones; trace with packed= matching the data")
        self.lr = lr
        self.n_tokens = int(sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in batch))  # the global step's
        if self.comm is not None:
            batch = local_batch(batch, self.program.n_micro_batches, self.rank, self.comm.size)
        if self.n_tokens == 0:
            raise ValueError("every target of this step is ignored (-100): nothing to train on")
        self.losses = [torch.zeros((), dtype=torch.float32)] * len(batch)
        self.routing_logs, self.gathered_routing = {}, {}
        self._begin_resident()
        self._place(batch)

    def _place(self, batch: list[tuple[torch.Tensor, ...]]) -> None:
        """The micro-batches into the `batch` buffer, with their packing's segments."""
        segments = [packing(mb[2]) if len(mb) == 3 else {} for mb in batch]  # on the host: no device sync later

        def place():  # on the compute stream, so the copies are ordered before the step's first use
            dev = self.device.torch_device
            self.bufs["batch"] = [
                (x.to(dev, non_blocking=True), y.to(dev, non_blocking=True),
                 {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in seg.items()})
                for (x, y, *_), seg in zip(batch, segments)]

        self.device.submit("compute", place, "place(batch)")

    def end(self) -> float:
        """Wait for this step's compute (not its host optimizer) and return the mean token loss. A marker
        behind the step's last host-stream op notes when its state is final (`final_time`)."""
        step, finals = self.step_index, self.finals

        def mark():
            finals[step] = time.perf_counter()
            while len(finals) > 64:  # NOTE: only the last few steps are ever asked for
                finals.pop(next(iter(finals)))

        self.device.submit("host", mark, f"end of step {step}")
        self.device.synchronize("compute")
        self._end_resident(step)
        self.step_index += 1
        total = float(sum(float(x) for x in self.losses))
        if self.comm is not None:
            total = self.comm.sum([total], what="the step's loss")[0]
        return total / self.n_tokens

    def final_time(self, step: int, wait: bool = True) -> float | None:
        """The perf_counter time when engine step `step`'s host stream finished, i.e. when its master weights
        and moments were final; None if not yet (`wait=False`). Waiting drains the host stream up to that step
        (the other streams run on)."""
        if step not in self.finals and wait:
            self.device.synchronize("host")
        return self.finals.get(step)

    def grad_norm(self, step: int | None = None) -> float | None:
        """The global gradient norm of engine step `step` (default: the step `end()` last finished), once that
        step's clip_grads has run on the host stream, which may still be behind the compute when `end()`
        returns; None for a program without clip_grads. Waits only for the clip, not the optimizer steps; a
        device failure raises DeviceError rather than waiting for a clip that will never run."""
        if not self._clips:
            return None
        step = self.step_index - 1 if step is None else step
        while (norm := self.store.grad_norm(step, timeout=0.05)) is None:
            if self.device.failed or self.device.closed:
                self.device.synchronize()  # raises the failure (or that the device is closed)
        return norm

    # -- instructions ---------------------------------------------------------------------------------------
    def alloc(self, i: int, buffer: str) -> None:
        tensors = checkpoint_tensors(self.ir, self.program.buffer(buffer))

        def run():
            self.bufs[buffer] = tuple(self.device.empty(s.shape, DTYPES[s.dtype]) for s in tensors)
            self.device.pool.alloc(buffer, _nbytes(self.bufs[buffer]))

        self._submit("compute", i, f"alloc({buffer})", run)

    def load_params(self, i: int, unit: str, slot: int, shard: bool = False) -> None:
        u, st = self.units[unit], self.store.units[unit]
        n = st.unit.flat_numel  # the store's: the rank's shard with `shard`
        lo = self.rank * n if shard else 0

        def run():
            self.store.load_params(unit, self.bufs[f"slot{slot}"][lo : lo + n], self.device)
            if u.buffers:
                self.device.copy(slot_buffers(self.bufs[f"slot{slot}"], u, self.ir.dtype), st.buffers)

        self._submit("h2d", i, f"load_params({unit}, slot={slot})", run)

    def forward(self, i: int, unit: str, slot: int, mb: int, mode: str = "plain") -> None:
        """Run the unit on micro-batch `mb`; its `mode` says what it keeps for its backward (ir/program.py)."""
        logs, scale = self.routing_logs, 1.0 / self.n_tokens if mode != "eval" else 0.0

        def run():
            u = self.units[unit]
            # an evaluation's forward runs outside a step: nothing logged, no aux loss (models/routing.py)
            with nullcontext() if mode == "eval" else self._forward_context(logs, unit, mb, scale):
                if mode == "keep":
                    params, carry, out, nbytes = self._forward_with_graph(u, slot, mb)
                    self._put(f"saved.{unit}.{mb}", (params, carry, out), nbytes)
                elif mode == "rebuild":  # also keep the sub-layer inputs the backward rebuilds the carry-in from
                    with torch.no_grad():
                        out, side = self._run(u, self._params(u, slot), self._carry(u, mb), self._inputs(u, mb),
                                              self._buffers(u, slot), record=True)
                    self._put(f"side.{unit}.{mb}", side, _nbytes(side))
                elif mode == "replay":  # also keep the fused attention's outputs, which the backward's recompute replays
                    rec = Record()
                    with torch.no_grad(), record_attention(rec):
                        out = run_unit(self.templates[u.template], self._params(u, slot), self._carry(u, mb),
                                       self._inputs(u, mb), self._buffers(u, slot))
                    kept = self._kept(u, rec)
                    self._put(f"attn.{unit}.{mb}", kept if kept is not None else self._placeholder(u), u.replay_bytes)
                    self.records[(unit, mb)] = rec if kept is not None else None
                else:
                    with torch.no_grad():
                        out = self._run(u, self._params(u, slot), self._carry(u, mb), self._inputs(u, mb),
                                        self._buffers(u, slot))
            if u.kind == "head":
                self.losses[mb] = out[0].detach()
            else:
                nxt = tuple(o.detach() for o in out)
                self._put(f"carry.{self.next_unit[unit]}.{mb}", nxt, _nbytes(nxt))

        self._submit("compute", i, f"forward({unit}, slot={slot}, mb={mb}, mode={mode})", run)

    def backward(self, i: int, unit: str, slot: int, grad_slot: int, mb: int, source: str = "recompute",
                 accumulate: bool = False, norm: bool = False) -> None:
        """Back-propagate through the unit's graph, from where `source` says (ir/program.py)."""
        scale = 1.0 / self.n_tokens

        def run():
            u = self.units[unit]
            side = self.bufs[f"side.{unit}.{mb}"] if source == "rebuild" else None
            if side is not None:  # the carry-in from the next unit's, then a recompute on the recorded inputs
                with torch.no_grad():
                    rebuilt = self._run(u, self._params(u, slot), self.bufs[f"carry.{self.next_unit[unit]}.{mb}"],
                                        self._inputs(u, mb), self._buffers(u, slot), rebuild=side)
                self._put(f"carry.{unit}.{mb}", rebuilt, _nbytes(rebuilt))
            if source == "saved":  # the program frees it after this backward
                params, carry, out = self.bufs[f"saved.{unit}.{mb}"]
            else:
                with self._recompute_context(unit, mb, scale):
                    # a recompute: its output is only back-propagated through, so a block skips what no gradient
                    # reads; the attention outputs the forward recorded, where the checkpoint is now (None: it
                    # could not record them)
                    rec = self.records.pop((unit, mb)) if source == "replay" else None
                    record = (rec, self.bufs[f"attn.{unit}.{mb}"]) if rec is not None else None
                    params, carry, out, _ = self._forward_with_graph(u, slot, mb, side, recompute=True,
                                                                     record=record)
            if u.kind == "head":
                grad_out = (torch.full((), 1.0 / self.n_tokens, dtype=out[0].dtype, device=out[0].device),)
            else:
                grad_out = self.bufs[f"dcarry.{self.next_unit[unit]}.{mb}"]
            wrt_carry = [c for c in carry if c.requires_grad]
            grads = torch.autograd.grad(out, [*params.values(), *wrt_carry], grad_out, allow_unused=True)
            self._write_grads(u, grad_slot, grads[: len(params)], accumulate)
            if norm:
                self._write_norms(u, grad_slot)
            if u.kind != "embed":
                dcarry = tuple(g.detach() for g in grads[len(params):])
                self._put(f"dcarry.{unit}.{mb}", dcarry, _nbytes(dcarry))

        self._submit("compute", i, f"backward({unit}, slot={slot}, grad_slot={grad_slot}, mb={mb}, source={source})",
                     run)

    def offload_act(self, i: int, buffer: str) -> None:
        def run():
            src = self.bufs[buffer]
            long = _nbytes(src) > STAGING_BYTES  # through the pinned staging buffers, into pageable memory
            for dst, s in zip(self.store.host_act(buffer), src):  # allocated with the store
                if long:
                    self.staging.to_host(dst, s)
                else:
                    self.device.copy(dst, s)

        self._submit("d2h", i, f"offload_act({buffer})", run)

    def load_act(self, i: int, buffer: str) -> None:
        def run():
            long = _nbytes(self.bufs[buffer]) > STAGING_BYTES
            for dst, src in zip(self.bufs[buffer], self.store.host_act(buffer)):
                if long:
                    self.staging.to_device(dst, src)
                else:
                    self.device.copy(dst, src)

        self._submit("h2d", i, f"load_act({buffer})", run)

    def store_grads(self, i: int, unit: str, grad_slot: int, host_grad: int = 0, shard: bool = False) -> None:
        u, st, logs, gathered = self.units[unit], self.store.units[unit], self.routing_logs, self.gathered_routing
        n = st.unit.flat_numel  # the store's: the rank's shard with `shard`
        lo = self.rank * n if shard else 0

        def run():
            flat = self.bufs[f"grad{grad_slot}"]
            self.device.copy(self.store.grad_target(unit, host_grad), flat[lo : lo + n])  # in the policy's dtype
            self.device.copy(st.norms, flat[u.flat_numel : u.flat_numel + len(st.norms)])
            if u.buffers:
                self._hand_routing(u, logs, gathered)

        self._submit("d2h", i, f"store_grads({unit}, grad_slot={grad_slot}, host_grad={host_grad}"
                     f"{', shard=True' if shard else ''})", run)

    def clip_grads(self, i: int) -> None:
        # NOTE: bind this step's losses list and index now: the next begin() replaces them while the host
        # stream may still be behind. The losses are ready here: the head's forwards precede every store.
        losses, step, lr = self.losses, self.step_index, self.lr
        self._submit("host", i, "clip_grads()", lambda: self.store.clip_grads(step, losses, lr))

    def optimizer_step(self, i: int, unit: str, host_grad: int = 0) -> None:
        lr, step = self.lr, self.step_index
        self._submit("host", i, f"optimizer_step({unit}, host_grad={host_grad})",
                     lambda: self.store.step_unit(unit, lr, step, host_grad))

    def device_step(self, i: int, unit: str, slot: int, grad_slot: int) -> None:
        """AdamW on a device-resident unit's state, on the device (resident.py)."""
        lr, step = self.lr, self.step_index
        self._submit("compute", i, f"device_step({unit}, slot={slot}, grad_slot={grad_slot})",
                     lambda: self._step_resident(unit, grad_slot, lr, step))

    def store_norms(self, i: int, unit: str, grad_slot: int) -> None:
        """A device-resident unit's per-parameter gradient norms to the host store (clip_grads, the verdict)."""
        self._submit("d2h", i, f"store_norms({unit}, grad_slot={grad_slot})", lambda: self._land_norms(unit, grad_slot))

    def record(self, i: int, stream: str, event: str) -> None:
        self.device.record(stream, event, self._event_index())

    def wait(self, i: int, stream: str, event: str, previous_step: bool = False) -> None:
        self.device.wait(stream, event, self._event_index() - (1 if previous_step else 0))

    def _event_index(self) -> int:
        """The index a record marks its event at: the step's, or the running evaluation's (evaluation.py)."""
        return self.step_index if self.eval_events is None else self.eval_events

    def free(self, i: int, buffer: str) -> None:
        def run():
            self.bufs.pop(buffer)
            self.device.pool.free(buffer)

        self._submit("compute", i, f"free({buffer})", run)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _submit(self, stream: str, i: int, label: str, fn) -> None:
        if self.timeline is not None:
            fn = self._timed(stream, label, fn)
        self.device.submit(stream, fn, f"instruction {i} {label} (step {self.step_index})")

    def _put(self, name: str, value, nbytes: int) -> None:
        self.device.pool.alloc(name, nbytes)
        self.bufs[name] = value

    def _write_grads(self, u: UnitIR, grad_slot: int, grads, accumulate: bool) -> None:
        flat = self.bufs[f"grad{grad_slot}"]
        for p, g in zip(u.params, grads):
            dst = flat[p.offset : p.offset + p.numel]
            if g is None:
                if not accumulate:
                    dst.zero_()
            elif accumulate:
                dst.add_(g.reshape(-1))
            else:
                dst.copy_(g.reshape(-1))


    def _write_norms(self, u: UnitIR, grad_slot: int) -> None:
        """The per-parameter L2 norms of the unit's final gradients, after them in the gradient slot: what
        torch.nn.utils.clip_grad_norm_ computes per parameter (torch._foreach_norm), on the device."""
        flat = self.bufs[f"grad{grad_slot}"]
        norms = torch._foreach_norm([flat[p.offset : p.offset + p.numel] for p in u.params], 2.0)
        torch.stack(norms, out=flat[u.flat_numel : u.flat_numel + len(u.params)])


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)
