"""The engine: executes a step program's instructions on a device, making no decisions of its own.

Where it sits: codegen (codegen/) turns a Plan's Program into `step(rt, batch)`, a straight-line Python
function calling one method of this class per instruction; each method submits a closure to its stream on
the device (device.py), so the calls return at once and the streams run concurrently, ordered only by the
program's record/wait events. Errors inside a stream name the instruction that failed.

How a unit runs: its template (models/) is bound to views of the slot holding its weights (no copies) with
torch.func.functional_call, tiled in chunks of the plan's `ir.chunk_tokens` (models/tiled.py) when set. Forward runs without autograd and keeps the unit's carry-in as its checkpoint;
backward recomputes the unit from that checkpoint with autograd, back-propagates with torch.autograd.grad,
and writes the parameter gradients into a fp32 gradient slot (adding across micro-batches).

Host memory is the store's (store.py): load_params asks it to feed the slot (from the pinned masters, or cast
through its staging ring), store_grads lands gradients in the program's host gradient buffer (`host_grad`, in
the host policy's dtype) with the per-parameter norms a `backward(norm=True)` wrote after them in the gradient
slot, and checkpoints go to its pinned copies.

Units with buffers (MoE routing state, models/routing.py): load_params copies them into the slot after the
weights; every unit runs in a routing step context. A forward instruction records the step's routing
statistics in a RoutingLog per (unit, micro-batch), and the experts' row counts it read from the device; a
backward's recompute replays those counts (the buffers change only at the optimizer step, so it routes the
same way) without reading anything back, and records nothing. store_grads hands the unit's logs to the host store
with its gradients, and the store's optimizer step updates the buffers from them.

A world program (`program.world_size` R > 1, planner/world.py) runs with a Communicator (distributed.py): `begin`
takes the global step's micro-batches and keeps this rank's group (the 1/tokens scale counts every rank's
tokens), `end` sums the loss across ranks, `load_params(shard=True)` / `store_grads(shard=True)` move this
rank's shard (elements [r S, (r+1) S) of the padded flat buffer; S is the shard the store holds), and
`all_gather`, `reduce_scatter`, `all_reduce` run on the comm stream; the gradient collectives also write the
norms of what the rank keeps and gather every rank's routing records, which store_grads then hands over.
"""

from __future__ import annotations

import time
import warnings

import torch

from megatrain.ir.model_ir import ModelIR, UnitIR
from megatrain.ir.program import STAGING_BYTES, Program, checkpoint_tensors
from megatrain.ir.trace import DTYPES
from megatrain.models import (
    ModelConfig,
    StepInputs,
    packing,
    recompute_mode,
    rope_tables,
    routing,
    run_unit,
    templates,
    views,
)
from megatrain.models.binding import buffer_views, slot_buffers
from megatrain.models.loss import IGNORE_INDEX
from megatrain.models.replay import Record, record_attention, replay_attention

from .compiled import runners
from .device import Device
from .distributed import local_batch
from .staging import Staging
from .store import HostStore


class Engine:
    """The `rt` of a generated step program."""

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
        self.routing_logs: dict[str, dict[int, routing.RoutingLog]] = {}  # this step's, by unit and micro-batch
        self.gathered_routing: dict[str, list] = {}  # every rank's records of a unit, global order (a world)
        self.gathered = frozenset(i.unit for i in program.instrs if i.op == "all_gather")  # its sharded units
        self.timeline: list[tuple] | None = None  # (stream, label, start, end, pool bytes) when tracing
        self.finals: dict[int, float] = {}  # engine step -> perf_counter time its state was final
        self.staging = Staging(device, STAGING_BYTES, store.checkpoint_staging)  # long checkpoints' copies
        self._clips = any(i.op == "clip_grads" for i in program.instrs)
        self._allocate_static()

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
        segments = [packing(mb[2]) if len(mb) == 3 else {} for mb in batch]  # on the host: no device sync later

        def place():  # on the compute stream, so the copies are ordered before the step's first use
            dev = self.device.torch_device
            self.bufs["batch"] = [
                (x.to(dev, non_blocking=True), y.to(dev, non_blocking=True),
                 {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in seg.items()})
                for (x, y, *_), seg in zip(batch, segments)]

        self.device.submit("compute", place, "begin(batch)")

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

    def routing_metrics(self) -> dict:
        """The last step's routing metrics (routing.summarize); {} for a model without MoE layers. In a world:
        this rank's micro-batches (the buffers' update reads every rank's)."""
        moe = self.config.moe
        if moe is None:
            return {}
        logs = {unit: [by_mb[mb].records for mb in sorted(by_mb)] for unit, by_mb in self.routing_logs.items()}
        return routing.summarize(logs, moe.top_k)

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

    def forward(self, i: int, unit: str, slot: int, mb: int, keep_graph: bool = False, rebuild: bool = False,
                replay: bool = False) -> None:
        logs, scale = self.routing_logs, 1.0 / self.n_tokens

        def run():
            u = self.units[unit]
            log = logs.setdefault(unit, {}).setdefault(mb, routing.RoutingLog())
            with routing.step_context(log, scale):
                if keep_graph:
                    params, carry, out, nbytes = self._forward_with_graph(u, slot, mb)
                    self._put(f"saved.{unit}.{mb}", (params, carry, out), nbytes)
                elif rebuild:  # also keep the sub-layer inputs the backward rebuilds the carry-in from
                    with torch.no_grad():
                        out, side = self._run(u, self._params(u, slot), self._carry(u, mb), self._inputs(u, mb),
                                              self._buffers(u, slot), record=True)
                    self._put(f"side.{unit}.{mb}", side, _nbytes(side))
                elif replay:  # also keep the fused attention's outputs, which the backward's recompute replays
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

        self._submit("compute", i, f"forward({unit}, slot={slot}, mb={mb})", run)

    def backward(self, i: int, unit: str, slot: int, grad_slot: int, mb: int, accumulate: bool = False,
                 rebuild: bool = False, norm: bool = False, replay: bool = False) -> None:
        scale = 1.0 / self.n_tokens

        def run():
            u = self.units[unit]
            saved = self.bufs.get(f"saved.{unit}.{mb}")  # the program frees it after this backward
            side = self.bufs.get(f"side.{unit}.{mb}") if rebuild else None
            if side is not None:  # the carry-in from the next unit's, then a recompute on the recorded inputs
                with torch.no_grad():
                    rebuilt = self._run(u, self._params(u, slot), self.bufs[f"carry.{self.next_unit[unit]}.{mb}"],
                                        self._inputs(u, mb), self._buffers(u, slot), rebuild=side)
                self._put(f"carry.{unit}.{mb}", rebuilt, _nbytes(rebuilt))
            if saved is not None:
                params, carry, out = saved
            else:
                routed = self.routing_logs.get(unit, {}).get(mb)  # the row counts its forward read
                with routing.step_context(None, scale, replay=routed.counts if routed else None):
                    # a recompute: route as the forward did (no read from the device), record nothing; its
                    # output is only back-propagated through, so a block skips what no gradient reads
                    # the attention outputs the forward recorded, where the checkpoint is now (None: it could not)
                    rec = self.records.pop((unit, mb)) if replay else None
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

        self._submit("compute", i, f"backward({unit}, slot={slot}, grad_slot={grad_slot}, mb={mb})", run)

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
            if u.buffers:  # the statistics its buffers' update needs travel with the gradients
                if unit in gathered:
                    self.store.put_routing(unit, [[{k: v.to("cpu") for k, v in r.items()} for r in mb]
                                                  for mb in gathered[unit]])
                else:
                    by_mb = logs.get(unit, {})
                    self.store.put_routing(unit, [by_mb[mb].to_host(self.device.to_host) for mb in sorted(by_mb)])

        self._submit("d2h", i, f"store_grads({unit}, grad_slot={grad_slot}, host_grad={host_grad}"
                     f"{', shard=True' if shard else ''})", run)

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

    def _gather_routing(self, u: UnitIR, logs: dict, gathered: dict) -> None:
        """Every rank's routing records of `u` into `gathered` (its forwards are done: its backward preceded
        this). NOTE: `logs` and `gathered` are the step's, bound when the op was issued: the next begin()
        replaces them while this stream may still be behind."""
        if u.buffers:
            by_mb = logs.get(u.name, {})
            gathered[u.name] = self.comm.gather_records([by_mb[mb].records for mb in sorted(by_mb)])

    def clip_grads(self, i: int) -> None:
        # NOTE: bind this step's losses list and index now: the next begin() replaces them while the host
        # stream may still be behind. The losses are ready here: the head's forwards precede every store.
        losses, step, lr = self.losses, self.step_index, self.lr
        self._submit("host", i, "clip_grads()", lambda: self.store.clip_grads(step, losses, lr))

    def optimizer_step(self, i: int, unit: str, host_grad: int = 0) -> None:
        lr, step = self.lr, self.step_index
        self._submit("host", i, f"optimizer_step({unit}, host_grad={host_grad})",
                     lambda: self.store.step_unit(unit, lr, step, host_grad))

    def record(self, i: int, stream: str, event: str) -> None:
        self.device.record(stream, event, self.step_index)

    def wait(self, i: int, stream: str, event: str, previous_step: bool = False) -> None:
        self.device.wait(stream, event, self.step_index - 1 if previous_step else self.step_index)

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

    def start_timeline(self) -> None:
        """Record every op's span from now on (see measured_spans)."""
        self.timeline = []
        self._t0 = time.perf_counter()
        self._t0_event = None
        if self.device.kind == "cuda":
            self._t0_event = torch.cuda.Event(enable_timing=True)
            self._t0_event.record()

    def measured_spans(self) -> list[tuple[str, str, int, float, float, int]]:
        """(stream, label, step, start s, end s, pool bytes) after the device drains; CUDA events resolved."""
        self.device.synchronize()
        out = []
        for stream, label, step, a, b, mem in self.timeline or []:
            if not isinstance(a, float):
                a, b = self._t0_event.elapsed_time(a) / 1e3, self._t0_event.elapsed_time(b) / 1e3
            else:
                a, b = a - self._t0, b - self._t0
            out.append((stream, label, step, a, b, mem))
        return sorted(out, key=lambda s: s[3])

    def _timed(self, stream: str, label: str, fn):
        """Wrap an op to record its span: wall time on sim and host, CUDA events on GPU streams."""
        gpu = self.device.kind == "cuda" and stream != "host"
        step = self.step_index

        def run():
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
            else:
                start = time.perf_counter()
                fn()
                end = time.perf_counter()
            self.timeline.append((stream, label, step, start, end, self.device.pool.current))

        return run

    def _put(self, name: str, value, nbytes: int) -> None:
        self.device.pool.alloc(name, nbytes)
        self.bufs[name] = value

    def _params(self, u: UnitIR, slot: int) -> dict[str, torch.Tensor]:
        return views(self.bufs[f"slot{slot}"], u.params)

    def _buffers(self, u: UnitIR, slot: int) -> dict[str, torch.Tensor] | None:
        """Views of the unit's buffers in its slot (None for a unit without)."""
        if not u.buffers:
            return None
        return buffer_views(slot_buffers(self.bufs[f"slot{slot}"], u, self.ir.dtype), u.buffers)

    def _run(self, u: UnitIR, params, carry, inputs, buffers, **mode):
        """Unit `u`'s template on bound parameters (models.run_unit, or its compiled runner)."""
        return self.runners[u.template](self.templates[u.template], params, carry, inputs, buffers, **mode)

    def _carry(self, u: UnitIR, mb: int) -> tuple[torch.Tensor, ...]:
        return () if not u.carry_in else self.bufs[f"carry.{u.name}.{mb}"]

    def _inputs(self, u: UnitIR, mb: int) -> StepInputs:
        tokens, targets, packed = self.bufs["batch"][mb]
        cos, sin = self.bufs["rope"]
        return StepInputs(tokens=tokens, targets=targets, cos=cos, sin=sin, loss_chunk=self.loss_chunk,
                          chunk_tokens=self.ir.chunk_tokens, **packed)

    def _forward_with_graph(self, u: UnitIR, slot: int, mb: int, side=None, recompute: bool = False, record=None):
        """Forward with autograd from the unit's checkpoint; returns (params, carry, out, saved bytes).
        `recompute`: for a backward that reads none of `out`'s values (models/transformer.py BlockUnit);
        `record`: (Record, its kept tensors) the recompute replays attention from (models/replay.py)."""
        params = {n: v.detach().requires_grad_() for n, v in self._params(u, slot).items()}
        buffers = self._buffers(u, slot)
        carry = tuple(c.detach().requires_grad_(c.is_floating_point()) for c in self._carry(u, mb))
        inputs = self._inputs(u, mb)
        # Saved bytes count what the graph adds: not the parameters, the carry, the batch or the RoPE tables.
        resident = (inputs.tokens, inputs.targets, inputs.cos, inputs.sin, *(buffers or {}).values())
        known = {t.untyped_storage().data_ptr() for t in (*params.values(), *carry, *resident)}
        saved: dict[int, int] = {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in known:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mode = recompute_mode(u.kind) if recompute else {}
            if side is not None:
                mode["side"] = side
            if record is None:
                out = self._run(u, params, carry, inputs, buffers, **mode)
            else:  # eager: a compiled runner would not dispatch the fused call to the mode
                with replay_attention(*record):
                    out = run_unit(self.templates[u.template], params, carry, inputs, buffers, **mode)
        return params, carry, out, sum(saved.values())

    def _kept(self, u: UnitIR, rec: Record) -> tuple[torch.Tensor, ...] | None:
        """The tensors of a forward's attention record, or None where they are not the trace's (UnitIR.replay):
        a device whose SDPA chose another kernel than the one traced. The backward then recomputes attention,
        as without replay (same gradients, the time the plan saved not saved), and the run says so once."""
        got = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in rec.tensors]
        want = [(tuple(s.shape), s.dtype) for s in u.replay]
        if got == want:
            return tuple(rec.tensors)
        if u.name not in self.unreplayed:
            self.unreplayed.add(u.name)
            warnings.warn(f"{u.name}: the device's fused attention ({', '.join(map(str, rec.ops))}) returned "
                          f"{got} where the plan traced {want}; its backward recomputes attention instead of "
                          "replaying it", RuntimeWarning, stacklevel=2)
        return None

    def _placeholder(self, u: UnitIR) -> tuple[torch.Tensor, ...]:
        """The attention buffer of a forward that could not record: the plan's shapes, nothing in them."""
        return tuple(self.device.empty(s.shape, DTYPES[s.dtype]) for s in u.replay)

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


def evaluate(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean token loss of `batches` under the current weights: a forward-only pass, unit-major so each
    unit's weights cross the link once, through slot 0. Runs synchronously after the step's streams drain;
    its carries are accounted in the device pool like the step's. Units run in eval mode: MoE routing takes
    its inference rule (ET: the pure threshold test). In a world every rank calls it with the same batches:
    each evaluates every R-th one, a sharded unit's slot is completed by an all_gather (the comm stream is
    drained, so the caller may use its group), and the loss is summed across ranks."""
    dev = engine.device
    dev.synchronize()
    for template in engine.templates.values():
        template.eval()
    result: list[float] = []
    try:
        # NOTE: on the compute stream, as the step's own work: its memory comes from that stream's pool, and
        # on CUDA no kernel of it runs on the default stream
        mine = batches if engine.comm is None else batches[engine.comm.rank :: engine.comm.size]
        n_tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in mine)  # on the host: no device sync
        dev.submit("compute", lambda: result.append(_evaluate(engine, mine)), "evaluate(validation)")
        dev.synchronize()
        total = result[0]
        if engine.comm is not None:
            total, n_tokens = engine.comm.sum([total, float(n_tokens)], what="the evaluation loss")
        return total / max(n_tokens, 1)
    finally:
        for template in engine.templates.values():
            template.train()


def _evaluate(engine: Engine, batches: list[tuple[torch.Tensor, ...]]) -> float:
    """The summed token loss of this rank's `batches`, on the compute stream; one read of the device."""
    dev = engine.device
    slot = engine.bufs["slot0"]
    staged = []
    comm = engine.comm
    for mb in batches:  # (tokens, targets) or (tokens, targets, positions)
        packed = packing(mb[2], dev.torch_device) if len(mb) == 3 else {}
        staged.append((mb[0].to(dev.torch_device, non_blocking=True), mb[1].to(dev.torch_device, non_blocking=True),
                       packed))
    cos, sin = engine.bufs["rope"]
    carries: list[tuple] = [()] * len(staged)
    total = torch.zeros((), dtype=torch.float32, device=dev.torch_device)
    with torch.no_grad():
        for u in engine.ir.units:
            if u.name in engine.gathered:
                n = engine.store.units[u.name].unit.flat_numel
                engine.store.load_params(u.name, slot[comm.rank * n : (comm.rank + 1) * n], dev)
                comm.all_gather_shards(slot[: u.flat_numel], f"evaluation all_gather({u.name})")
            else:
                engine.store.load_params(u.name, slot[: u.flat_numel], dev)
            if u.buffers:
                slot_buffers(slot, u, engine.ir.dtype).copy_(engine.store.units[u.name].buffers)
            params, buffers = views(slot, u.params), engine._buffers(u, 0)
            for b, (tokens, targets, packed) in enumerate(staged):
                inputs = StepInputs(tokens=tokens, targets=targets, cos=cos, sin=sin, loss_chunk=engine.loss_chunk,
                                    chunk_tokens=engine.ir.chunk_tokens, **packed)
                out = engine._run(u, params, carries[b], inputs, buffers)
                if carries[b]:
                    dev.pool.free(f"eval.{b}")
                if u.kind == "head":
                    total += out[0]  # summed on the device: one read of the loss at the end, not one a batch
                    carries[b] = ()
                else:
                    dev.pool.alloc(f"eval.{b}", _nbytes(out))
                    carries[b] = out
    return float(total)  # the one read of the device's sum
