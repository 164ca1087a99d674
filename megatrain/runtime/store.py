"""The host store: everything the host holds for streamed training, allocated once at exact sizes.

Where it sits: the engine (engine.py) calls `load_params` to feed a unit's weights into a device slot, copies
device gradients into `grad_target(unit, k)` (store_grads), reads the host checkpoint buffers of `host_act`
(offload_act/load_act), and calls `clip_grads` and `step_unit` on the host stream. Layouts come from the
ModelIR, so a flat buffer here and a device slot agree element for element. Creating the buffers (every page
touched on several threads, zero-filled only where zero is the initial value) is runtime/host_init.py's.

What it holds, by host policy (planner/host_policy.py; the plan counts the same buffers, `host_layout`):
per unit its fp32 master (flat, padding included), both AdamW moments in the policy's dtype (fp8: with block
scales) and AdamW's step counts; the host gradient buffers `hgrad{k}` of the program (store_grads'
`host_grad`: a ring the units stepped as their gradients land take turns in, one of its own for each unit
whose gradient waits), in the policy's gradient dtype; the per-parameter gradient norms the device computes
(`backward(norm=True)`); a pinned staging ring for bf16 runs; unit buffers (MoE routing state) and host
checkpoints. Everything a copy touches is pinned (runtime/host_memory.py). Where a bf16 unit's compute-dtype
weights come from is the plan's `cast` place (planner/cast.py, runtime/cast.py `feed`): by default cast from
its master into the staging ring chunk by chunk as it streams; or its pinned fp32 master crosses and the
device casts it; or a persistent bf16 copy (`copy.{unit}`) that each optimizer step writes besides master and
moments. An fp32 unit's pinned master crosses the link itself. Without a program (tests of the math) every
unit has a gradient buffer of its own, and bf16 casts on the host.

A unit whose state lives on the device (runtime/resident.py) has no host gradient buffer; its master and moments
here are its mirror: `mirror` (the engine) brings them up to date before a read through views (state_tensors,
named_master) and uploads them again before the next step after a write.

Tied parameters (the LM head sharing the embedding) are owned by one unit: its master and moments live
there; a borrower's load takes the tied slices from the owner's master, and its gradient is added to the
owner's at the owner's step (or at clip_grads). The borrower's master and moments hold only its owned
parameters, back to back (UnitIR.host_params: for Llama-3.2-3B's head that leaves out 394M elements, 4.7 GB
of fp32 master and moments); its gradient buffer keeps the device's flat layout, tied slice included.
NOTE: under a policy holding bf16 gradients that sum adds two bf16 gradients where the eager reference rounds
the fp32 sum once, so a tied model under bf16 or fp8 matches it to bf16 round-off, not bit
for bit (untied models are bit-exact under every policy; tied ones under exact and bf16-moments are as
before: tests/runtime/test_exactness.py).

The gradient norm for clipping is never re-read from host gradients: clip_grads combines the device's
per-parameter norms (the norm of norms, as torch.nn.utils.clip_grad_norm_ computes it) except for a tied
owner's shared parameter, whose merged gradient exists only here. Numerical faults (`check_finite`, set by the
Trainer for --on-nan): the verdict is verdict.py's, from the same norms, so no pass over the gradients checks
them. At a clip_grads barrier the global norm and the step's losses decide for the whole step; without one,
each unit checks its own norms as it steps. A faulty step is recorded in `faults`
(drained by the Trainer) and every unit still to step in it skips its update (with `stop_on_fault`, every
later update too), so no NaN or inf ever reaches a master weight or a moment. Checkpoints (checkpoint.py)
read and write the state through `state_tensors`, views of the store's own memory.

Buffers (MoE routing state, models/routing.py): one flat fp32 tensor per unit that has any, starting at 0 like
the eager model's, copied whole into the device slot by load_params. The engine's store_grads hands over the
step's routing records (`put_routing`); `step_unit` updates the buffers from them right after the unit's
AdamW update (moe_logs.py `update_unit_buffers`), once per optimizer step, as the eager reference does after
optimizer.step(). A skipped (faulty) step drops them.
"""

from __future__ import annotations

import threading

import torch

from megatrain.ir.layout import buffer_views
from megatrain.ir.model_ir import ModelIR, ParamSlice, UnitIR
from megatrain.ir.program import STAGING_BYTES, Program, checkpoint_tensors
from megatrain.ir.trace import DTYPES as TRACE_DTYPES
from megatrain.models import ModelConfig, decays, init_into, templates
from megatrain.planner.costs import default_cast
from megatrain.planner.host_policy import HostPolicy, grad_buffer_elems, resolve, staged
from megatrain.planner.train import TrainSpec

from . import host_init
from .cast import feed as cast_feed
from .cast import host_buffers as cast_buffers
from .host_adamw import Moments, grad_dtype, moment_dtype, n_blocks
from .host_memory import HostArena, HostBuffer
from .host_state import adamw_step
from .moe_logs import update_unit_buffers
from .optim import clip_coefficient
from .stochastic_round import param_key
from .verdict import growth, step_fault, unit_fault

KEEP_GRAD_NORMS = 16  # steps of global gradient norms kept for readers behind the host stream


class UnitState:
    """One unit's views into the store's buffers."""

    def __init__(self, unit: UnitIR, bufs: dict[str, torch.Tensor], policy: HostPolicy, norms: torch.Tensor):
        name = unit.name
        self.unit = unit
        self.owned = [p for p in unit.params if p.name not in unit.tied]  # at their flat-buffer (device) offsets
        self.host = list(unit.host_params())  # the same parameters at their offsets in master and moments
        self.decay = [decays(f"{name}.{p.name}", p.shape) for p in self.owned]  # AdamW's weight-decay groups
        # NOTE: nothing is zeroed here: host_init.prepare made every buffer present, zero where zero is its
        # initial value, and left the masters to what overwrites them (the initial weights, a checkpoint)
        self.master = bufs[f"master.{name}"]
        m, v = bufs[f"exp_avg.{name}"], bufs[f"exp_avg_sq.{name}"]
        self.moments = [Moments(m[p.offset : p.offset + p.numel], v[p.offset : p.offset + p.numel],
                                key=param_key(f"{name}.{p.name}")) for p in self.host]
        if policy.moments == "fp8":
            scales = bufs[f"scales.{name}"]
            at, half = 0, scales.numel() // 2
            for mom, p in zip(self.moments, self.owned):
                nb = n_blocks(p.numel)
                mom.avg_scale, mom.sq_scale = scales[at : at + nb], scales[half + at : half + at + nb]
                at += nb
        steps = bufs[f"steps.{name}"]
        self.steps = [steps[i] for i in range(len(self.owned))]
        self.buffers = bufs.get(f"buffers.{name}", torch.zeros(0))  # starting at 0 (models/routing.py)
        self.norms = norms  # the device's per-parameter gradient norms (unit.params order), fp32
        self.grad: torch.Tensor | None = None  # the flat host gradient of this step (a view of its hgrad{k})
        self.grad_buffer: int | None = None
        self.routing: list | None = None  # the step's routing records, per micro-batch, until the unit steps
        self.bound: float | None = None  # an upper bound on every |master| (None: not known; one pass finds it)

    def views(self, flat: torch.Tensor, params: list[ParamSlice] | None = None) -> list[torch.Tensor]:
        """The owned parameters' slices of a buffer in the device's flat layout (a gradient)."""
        return [flat[p.offset : p.offset + p.numel] for p in (params if params is not None else self.owned)]

    def master_views(self) -> list[torch.Tensor]:
        """The owned parameters' fp32 masters (host layout)."""
        return [self.master[p.offset : p.offset + p.numel] for p in self.host]

    def master_of(self, name: str) -> torch.Tensor:
        """One owned parameter's fp32 master (host layout), by its name in the unit."""
        p = next(q for q in self.host if q.name == name)
        return self.master[p.offset : p.offset + p.numel]


class HostStore:
    """All units' host state under `policy`, initialised from `init_weights(config, seed)` unit by unit, with
    the host buffers `program` needs (gradient buffers, checkpoints), on a `device` ("sim" or "cuda": whether
    pinned memory is page-locked)."""

    def __init__(self, ir: ModelIR, optim: TrainSpec, seed: int = 0, *, policy: HostPolicy | str = "exact",
                 program: Program | None = None, device: str = "sim", init: bool = True) -> None:
        self.ir, self.optim, self.program = ir, optim, program
        self.policy = resolve(policy)
        self._exact = self.policy.name == "exact"  # the update bound of exact moments (verdict.py)
        self.config = ModelConfig.model_validate(ir.config)
        self.compute_dtype = TRACE_DTYPES[ir.dtype]
        self.cast = (program.cast if program is not None else None) or default_cast(ir.dtype)  # planner/cast.py
        self.arena = HostArena(device)
        self._assignment = self._grad_assignment(program)
        bufs = self._bufs = self.arena.allocate(self._buffers())
        host_init.prepare(bufs, ir.units, zero_grads=program is None)
        offsets = [0]
        for u in ir.units:
            offsets.append(offsets[-1] + len(u.params))
        self.units: dict[str, UnitState] = {
            u.name: UnitState(u, bufs, self.policy, bufs["norms"][offsets[i] : offsets[i + 1]])
            for i, u in enumerate(ir.units)}
        self.grad_buffers = [bufs[f"hgrad{k}"] for k in range(len(grad_buffer_elems(ir, self._assignment)))]
        self.stage = [bufs[f"stage{k}"] for k in range(2) if f"stage{k}" in bufs]
        self.host_acts = {name: tuple(bufs[f"host:{name}.{j}"] for j in range(len(self._act_tensors(name))))
                          for name in self._offloaded()}
        self.checkpoint_staging = {stream: [bufs[f"ckstage.{stream}.{k}"] for k in range(2)]
                                   for stream in ("d2h", "h2d")} if self._staged() else {}
        if program is None:  # NOTE: no program binds gradient buffers: each unit's own is its gradient
            for i, st in enumerate(self.units.values()):
                st.grad, st.grad_buffer = self.grad_buffers[i][: st.unit.flat_numel], i  # zero (prepare)
        self._sources = {u.name: self._load_sources(u) for u in ir.units}
        self.feed = cast_feed(self.cast, self, bufs)  # where load_params' compute-dtype weights come from
        self._shared = {(self._owner(ref), ref) for u in ir.units for ref in u.tied.values()}
        self._templates = templates(self.config) if any(u.buffers for u in ir.units) else {}
        self._lock = threading.Lock()
        self._merged: set[str] = set()  # owners whose borrowers' tied gradients were added this step
        self.clip_coef: torch.Tensor | None = None
        self.last_grad_norm: float | None = None
        # NOTE: per engine step, set by that step's clip_grads on the host stream, which may run behind the
        # compute: a reader waits for its step's entry (grad_norm) rather than reading last_grad_norm
        self.grad_norms: dict[int, float] = {}
        self._norms_ready = threading.Condition()
        self.check_finite = False  # the Trainer turns it on (--on-nan); tests of the math leave it off
        self.stop_on_fault = False  # --on-nan abort: after a fault, no further update at all
        self.faults: list[tuple[int, str]] = []  # (engine step index, what was not finite), drained by the Trainer
        self._fault_step: int | None = None  # the step whose remaining updates are skipped
        self._barrier_step: int | None = None  # the last step a clip_grads barrier checked globally
        # the engine's hook (runtime/resident.py) when some units' state lives on the device: their master and
        # moments here are its mirror, brought up to date before a read and re-uploaded after a write
        self.mirror = None
        if init:  # NOTE: a resumed run loads every value from a checkpoint; drawing 70B random numbers first is waste
            self._init(seed)

    # -- layout ------------------------------------------------------------------------------------------------
    def _grad_assignment(self, program: Program | None) -> list[int]:
        assignment: list[int | None] = list(range(len(self.ir.units)))
        if program is not None:
            index = {u.name: i for i, u in enumerate(self.ir.units)}
            for ins in program.instrs:
                if ins.op == "device_step":  # stepped on the device: no host gradient (planner/report.py agrees)
                    assignment[index[ins.unit]] = None
                if ins.op == "store_grads":
                    if ins.host_grad is None:
                        raise ValueError(f"{ins}: the program names no host gradient buffer; plan it again "
                                         "with this megatrain")
                    assignment[index[ins.unit]] = ins.host_grad
        return assignment

    def _offloaded(self) -> list[str]:
        return sorted({i.buffer for i in self.program.instrs if i.op == "offload_act"}) if self.program else []

    def _act_tensors(self, name: str) -> tuple:
        """The tensor specs of offloaded checkpoint buffer `name` (a carry, or an attention record)."""
        return checkpoint_tensors(self.ir, self.program.buffer(name))

    def _buffers(self) -> list[HostBuffer]:
        """Every host buffer of the run: what planner/host_policy.py `host_layout` counts."""
        pol, out = self.policy, []
        pinned_master, transfer = cast_buffers(self.ir, self.cast, self.compute_dtype)  # runtime/cast.py
        for u in self.ir.units:
            n, owned = u.host_numel, [p for p in u.params if p.name not in u.tied]
            out.append(HostBuffer(f"master.{u.name}", "master_fp32", (n,), torch.float32, pinned=pinned_master))
            for kind in ("exp_avg", "exp_avg_sq"):
                out.append(HostBuffer(f"{kind}.{u.name}", "moments", (n,), moment_dtype(pol), pinned=False))
            if pol.moments == "fp8":
                blocks = sum(n_blocks(p.numel) for p in owned)
                out.append(HostBuffer(f"scales.{u.name}", "moments", (2 * blocks,), torch.float32, pinned=False))
            out.append(HostBuffer(f"steps.{u.name}", "step_counts", (len(owned),), torch.float32, pinned=False))
            if u.buffers:
                out.append(HostBuffer(f"buffers.{u.name}", "unit_buffers", (sum(b.numel for b in u.buffers),),
                                      torch.float32, pinned=True))
        out.append(HostBuffer("norms", "grad_norms", (sum(len(u.params) for u in self.ir.units),), torch.float32,
                              pinned=True))
        for k, n in enumerate(grad_buffer_elems(self.ir, self._assignment)):
            out.append(HostBuffer(f"hgrad{k}", "grads", (n,), grad_dtype(pol), pinned=True))
        out += transfer  # the staging ring or the bf16 copy
        for name in self._offloaded():
            carry = self._act_tensors(name)
            pinned = not staged([t.nbytes for t in carry])  # a long one crosses through the staging buffers
            for j, t in enumerate(carry):
                out.append(HostBuffer(f"host:{name}.{j}", "checkpoints", t.shape, getattr(torch, t.dtype),
                                      pinned=pinned))
        if self._staged():
            out += [HostBuffer(f"ckstage.{stream}.{k}", "checkpoint_staging", (STAGING_BYTES,), torch.uint8,
                               pinned=True) for stream in ("d2h", "h2d") for k in range(2)]
        return out

    def _staged(self) -> bool:
        return any(staged([t.nbytes for t in self._act_tensors(n)]) for n in self._offloaded())

    def host_bytes(self) -> int:
        """Every host byte this store allocated (HostArena.allocated_bytes)."""
        return self.arena.allocated_bytes

    def close(self) -> None:
        self.arena.close()

    # -- initial weights ---------------------------------------------------------------------------------------
    def _init(self, seed: int) -> None:
        """init_weights' values drawn straight into the masters, every tensor in parallel (models.init_into)."""
        init_into(self.config, seed, {f"{st.unit.name}.{p.name}": v for st in self.units.values()
                                      for p, v in zip(st.owned, st.master_views())})

    def load_state(self, weights: dict[str, torch.Tensor]) -> None:
        """Set master weights from eager-named fp32 tensors (tests, checkpoint import)."""
        self._invalidate()
        for st in self.units.values():
            for p, v in zip(st.owned, st.master_views()):
                host_init.copy(v, weights[f"{st.unit.name}.{p.name}"].reshape(-1))

    def _invalidate(self) -> None:
        """Masters may be written through views handed out: their norms must be taken again (and a bf16 copy
        of them cast again, runtime/cast.py)."""
        self._mirror_touch()
        self.feed.invalidate()
        for st in self.units.values():
            st.bound = None

    def state_tensors(self, unit: str, mirror: bool = True) -> dict[str, torch.Tensor]:
        """A unit's checkpointed state as views of the store's memory (no copies), by checkpoint tensor name:
        `master/<param>` (fp32), `exp_avg/<param>`, `exp_avg_sq/<param>` (the parameter's shape, in the
        policy's moment dtype), `exp_avg_scale/<param>`, `exp_avg_sq_scale/<param>` (fp8: fp32 per block) and
        `step/<param>` (AdamW's fp32 step count) for every owned parameter, `buffer/<buffer>` for its buffers.
        Read them to save; write into them to load: what the masters feed (a bf16 copy, the overflow screen's
        bound) is taken again afterwards. `mirror=False`: the caller brought a device unit's mirror up to date
        itself (or the unit has none). A reader that writes nothing takes `state_views`."""
        st = self.units[unit]
        st.bound = None
        if mirror:
            self._mirror_touch()
        self.feed.invalidate(unit)
        return self.state_views(unit)

    def state_views(self, unit: str) -> dict[str, torch.Tensor]:
        """`state_tensors`' views, for a reader that writes nothing through them and brings a device unit's
        mirror up to date itself: no side effect, so a streamed checkpoint's write on the disk stream
        (checkpoint_stream.py) costs the step no recast of the unit's bf16 copy nor a pass for its bound."""
        st = self.units[unit]
        out: dict[str, torch.Tensor] = {}
        for p, v in zip(st.owned, st.master_views()):
            out[f"master/{unit}.{p.name}"] = v.view(p.shape)
        for kind in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            for p, mom in zip(st.owned, st.moments):
                t = mom.tensors().get(kind)
                if t is not None:
                    out[f"{kind}/{unit}.{p.name}"] = t.view(p.shape) if kind in ("exp_avg", "exp_avg_sq") else t
        for p, count in zip(st.owned, st.steps):
            out[f"step/{unit}.{p.name}"] = count
        for name, v in buffer_views(st.buffers, st.unit.buffers).items():
            out[f"buffer/{unit}.{name}"] = v
        return out

    def _mirror_touch(self) -> None:
        """The state is about to be read or written through views: a device unit's mirror is brought up to date
        first and uploaded again before the next step (runtime/resident.py)."""
        if self.mirror is not None:
            self.mirror.pull()
            self.mirror.stale()

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """Eager-named views of every unit's buffers (as EagerModel.named_buffers() names them)."""
        return {f"{st.unit.name}.{n}": v for st in self.units.values()
                for n, v in buffer_views(st.buffers, st.unit.buffers).items()}

    def named_master(self) -> dict[str, torch.Tensor]:
        """Eager-named views of the fp32 masters (owned parameters only)."""
        self._invalidate()
        return {f"{st.unit.name}.{p.name}": v.view(p.shape)
                for st in self.units.values() for p, v in zip(st.owned, st.master_views())}

    # -- what the engine's copies read and write -----------------------------------------------------------------
    def _load_sources(self, u: UnitIR) -> list[tuple[int, int, torch.Tensor]]:
        """(start, end, fp32 source) segments of `u`'s flat buffer: the whole master, or for a unit holding
        tied parameters each parameter from its own master or its owner's (the host layout: host_params)."""
        st = self.units[u.name]
        if not u.tied:
            return [(0, u.flat_numel, st.master)]
        out = []
        for p in u.params:
            ref = u.tied.get(p.name)
            if ref:
                owner = self.units[self._owner(ref)]
                src = owner.master_of(self._ref_name(ref, owner))
            else:
                src = st.master_of(p.name)
            out.append((p.offset, p.offset + p.numel, src))
        return out

    def load_params(self, unit: str, dst: torch.Tensor, device) -> None:
        """Copy `unit`'s weights into `dst` (a slot's first flat_numel elements, compute dtype) on `device`,
        through the feed of the plan's cast place (runtime/cast.py): fp32 straight from the pinned masters; bf16
        cast on the host into the staging ring chunk by chunk (the cast of one chunk overlapping the transfer
        of the one before), cast on the device from fp32, or copied from the optimizer's bf16 copy."""
        self.feed.load(self._sources[unit], dst, device)

    def grad_target(self, unit: str, host_grad: int) -> torch.Tensor:
        """Where store_grads lands `unit`'s gradients this step: host gradient buffer `host_grad`."""
        st = self.units[unit]
        if self.program is not None and self._assignment[st.unit.index] != host_grad:
            raise ValueError(f"store_grads({unit}) into hgrad{host_grad}, but the store was built for "
                             f"hgrad{self._assignment[st.unit.index]}: build the store with this program")
        st.grad, st.grad_buffer = self.grad_buffers[host_grad][: st.unit.flat_numel], host_grad
        return st.grad

    def host_act(self, buffer: str) -> tuple[torch.Tensor, ...]:
        """The host copy of an offloaded checkpoint (one tensor per carry tensor): pinned, or pageable when it
        crosses through `checkpoint_staging` (host_policy.staged)."""
        return self.host_acts[buffer]

    # -- the step ----------------------------------------------------------------------------------------------
    def _merge_tied_grads(self, owner: str | None = None) -> None:
        """Add borrowers' gradients of tied parameters into their owner's, once per step.

        store_grads overwrites each unit's host gradient, so this runs only once the owner's and the
        borrowers' gradients have landed: at clip_grads, or at the owner's optimizer_step (the borrower, the
        head, stores before the owner, the embedding, on the d2h stream)."""
        with self._lock:
            for other in self.units.values():
                for p in other.unit.params:
                    ref = other.unit.tied.get(p.name)
                    if not ref:
                        continue
                    own = self.units[self._owner(ref)]
                    if (owner is not None and own.unit.name != owner) or own.unit.name in self._merged:
                        continue
                    own.grad[self._slice(ref, own)] += other.grad[p.offset : p.offset + p.numel]
                    self._merged.add(own.unit.name)

    def _owner(self, ref: str) -> str:
        """The unit a 'unit.param' reference points into (unit names may contain dots)."""
        return max((n for n in self.units if ref.startswith(n + ".")), key=len)

    @staticmethod
    def _ref_name(ref: str, owner: UnitState) -> str:
        """The parameter's name inside `owner` of a 'unit.param' reference."""
        return ref[len(owner.unit.name) + 1 :]

    @classmethod
    def _slice(cls, ref: str, owner: UnitState) -> slice:
        """Where a referenced parameter lies in its owner's flat (device-layout) buffer: its gradient."""
        pname = cls._ref_name(ref, owner)
        p = next(q for q in owner.unit.params if q.name == pname)
        return slice(p.offset, p.offset + p.numel)

    def _norms(self, st: UnitState) -> list[torch.Tensor]:
        """The unit's owned parameters' gradient norms: the device's, or for a shared (tied) parameter the
        norm of its merged gradient, computed here."""
        out = []
        for j, p in enumerate(st.unit.params):
            if p.name in st.unit.tied:
                continue
            if (st.unit.name, f"{st.unit.name}.{p.name}") in self._shared:
                out.append(torch.linalg.vector_norm(st.grad[p.offset : p.offset + p.numel].float(), 2.0))
            else:
                out.append(st.norms[j])
        return out

    def clip_grads(self, step: int = -1, losses: list[torch.Tensor] | None = None, lr: float | None = None) -> None:
        """Global L2 norm over every owned gradient, as torch.nn.utils.clip_grad_norm_ computes it (the norm of
        the per-parameter norms, in parameter order), from the norms the device computed.

        The barrier of a step: every gradient has landed. With `check_finite`, a non-finite norm (or loss)
        marks the whole step faulty before any unit steps."""
        self._merge_tied_grads()
        total = self._global_norm([n for st in self.units.values() for n in self._norms(st)])
        self.last_grad_norm = float(total)
        with self._norms_ready:
            self.grad_norms[step] = self.last_grad_norm
            for old in [s for s in self.grad_norms if s < step - KEEP_GRAD_NORMS]:
                del self.grad_norms[old]
            self._norms_ready.notify_all()
        self.clip_coef = clip_coefficient(total, self.optim.clip_norm) if self.optim.clip_norm else None
        if self.check_finite:
            self._barrier_step = step
            fault = self._agree(step_fault(losses, self.last_grad_norm, self.units.values(), lr, self.optim,
                                           self._exact))
            if fault is not None:
                self._fault(step, fault)

    def _global_norm(self, norms: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the per-parameter norms, as clip_grad_norm_ takes it (a sharded store: of every rank's)."""
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def _agree(self, fault: str | None) -> str | None:
        """The step's verdict at the barrier: this store's (a sharded store: the first rank's that found one)."""
        return fault

    def grad_norm(self, step: int, timeout: float) -> float | None:
        """The global gradient norm clip_grads found at engine step `step`, waiting up to `timeout` seconds for
        it to run; None if it has not run by then (or was dropped: only the last few steps are kept)."""
        with self._norms_ready:
            self._norms_ready.wait_for(lambda: step in self.grad_norms, timeout)
            return self.grad_norms.get(step)

    def step_unit(self, unit: str, lr: float, step: int = -1, host_grad: int | None = None) -> None:
        """AdamW under the policy on one unit's masters (host_state.adamw_step), then its buffers' update
        (MoE routing, moe_logs.py). With `check_finite`, skipped (no change at all) in a step found faulty
        (verdict.py)."""
        st = self.units[unit]
        if host_grad is not None and host_grad != st.grad_buffer:
            raise ValueError(f"optimizer_step({unit}) from hgrad{host_grad}, but its gradients landed in "
                             f"hgrad{st.grad_buffer}")
        self._merge_tied_grads(unit)
        if self.check_finite and self._barrier_step != step and self._fault_step != step:
            # no barrier checked this step: the unit's norms decide (one flag; no pass over the gradients)
            fault = unit_fault(st, self._norms(st), lr, self.optim, self._exact)
            if fault is not None:
                self._fault(step, fault)
        if self.check_finite and (self._fault_step == step or (self.stop_on_fault and self._fault_step is not None)):
            st.routing = None
        else:
            a, b = growth(st, lr, self.optim, self._exact)
            adamw_step(self.policy, st.master_views(), st.views(st.grad), st.moments, st.steps, self.optim, lr,
                       st.decay, self.clip_coef, copies=self.feed.copies(unit))
            self.feed.stepped(unit)
            if st.bound is not None:
                st.bound = st.bound * a + b  # what the update can do to any weight: no pass over them
            if st.unit.buffers:
                update_unit_buffers(self._templates[st.unit.template], st)
        with self._lock:
            self._merged.discard(unit)

    def put_routing(self, unit: str, logs: list[list[dict[str, torch.Tensor]]]) -> None:
        """The step's routing records of `unit` (one list per micro-batch), for its optimizer step."""
        self.units[unit].routing = logs

    def _fault(self, step: int, what: str) -> None:
        with self._lock:
            self._fault_step = step
            self.faults.append((step, what))

    def take_faults(self) -> list[tuple[int, str]]:
        """The faults recorded since the last call: (engine step index, what was not finite)."""
        with self._lock:
            out, self.faults = self.faults, []
        return out
