"""Op costs from the hardware profile: the seconds each instruction takes on its stream.

Where it sits: the estimator (critical path of the instruction DAG) and the placement search's analytic
model both price ops here, so they agree on every figure. Try it:
`python -c "from megatrain.planner.costs import ADAMW_BYTES; print(ADAMW_BYTES)"`.

- forward: flops_fwd / achievable matmul FLOP/s + fx graph nodes x dispatch overhead;
- backward: (flops_bwd + the recompute's FLOPs unless the unit kept its graph (flops_fwd less what a
  recompute leaves unevaluated, UnitIR.recompute_flops, and less the fused attention's when it replays it,
  models/replay.py), + flops_fwd again when it rebuilds its carry-in) / FLOP/s + 2 x nodes x overhead;
- load_params / load_act: bytes / h2d bandwidth + copy latency. A bf16 unit's weights come from where the
  `cast` pass put the compute-dtype cast (planner/cast.py, `load_seconds_per_element`): "host", cast from the
  fp32 master into the pinned staging ring as it loads, in chunks that overlap the link: max(link 2 B, the
  profile's host cast rate on the h2d worker's threads); "gpu", the fp32 master crosses (4 B) and the device
  casts it: link + device cast; "copy", a plain DMA of the persistent bf16 copy (2 B), which the optimizer
  step writes (its traffic + 2 B per parameter);
- store_grads / offload_act: on d2h, gradients in the policy's host gradient dtype (bf16 ones are converted
  on the device, so half the bytes cross); checkpoints longer than one staging chunk cross in chunks through
  pinned staging (transfers.py), as load_act's do;
- optimizer_step: parameters x the bytes the policy's step moves (HostPolicy.traffic, ADAMW_BYTES) / host
  memory bandwidth. Per fp32-master parameter: master read + write (8), the gradient read (4, or 2 in bf16),
  both moments read + written (16 fp32, 8 bf16, 4 fp8 + block scales). Nothing else: the clip factor is
  applied inside the step's cache-sized chunks, the NaN/inf verdict comes from the device-side norms, and no
  transfer copy is refreshed (runtime/host_state.py). The rate is the profile's measured one for the policy
  (`host_optimizer_bytes_per_s`, from `megatrain probe`, under `NAME+clip` for a clipped step: a
  compressed policy's step is bound by arithmetic,
  not memory, on a host with few cores), else host_memory_bytes_per_s; benchmarks/bench_host_optimizer.py
  compares each policy's measured step with this price;
- clip_grads: combines per-parameter norms computed on the device (n_units x 1 us): no gradient is re-read;
- save_state (a checkpointing step's, checkpoint_writes.py): the unit file's bytes / the disk's write bandwidth
  + a write + fsync's fixed cost (`disk_write_bytes_per_s`, `disk_file_latency_s`); seal_checkpoint: three of
  those fixed costs (the RNG state, the manifest, the renamed folder).
- load_state (a resumed run's first step, checkpoint_reads.py): the unit file's bytes / the disk's read bandwidth
  (`disk_read_bytes_per_s`) + one file's fixed cost.
- device_step (a unit whose state lives on the device, issue 40): parameters x the bytes the AdamW step moves
  in device memory (`device_step_bytes`: master read + write, the fp32 gradient read, both moments read +
  written in the policy's dtype, and with a bf16 compute dtype the slot's bf16 weights written) / the
  profile's device_memory_bytes_per_s (host_memory_bytes_per_s where it has none), plus one dispatch per
  parameter; store_norms: the unit's per-parameter norms (4 B each) over d2h plus the copy latency.
With a measured unit profile (`Hardware.units`, planner/profile.py, from `megatrain probe --model`) every op
of a unit whose template it covers is priced from the measurement instead: forward without and with its
graph, backward from the graph, the recompute and rebuild it adds, the norm pass, load, store, checkpoint
offload and reload, the optimizer step under the policy (with or without a clip factor), a device-resident
unit's device step and norm store (profiles from version 11 on; older ones keep the roofline's), and every
instruction, record, wait and free included, costs the measured `dispatch_s` more; the estimator adds the
measured event wake-up and step gap (estimate.py) and stretches ops that overlap another stream's work by the
measured contention factors (contention.py). Units it does not cover keep the roofline.
NOTE: copies and compute are assumed not to slow each other (HBM has headroom at these rates), nor the
staging casts and the host optimizer, which share host DRAM (at most 6 B/param per load against the
optimizer's 14-28); a probe on the target machine is what makes the rates themselves trustworthy.
"""

from __future__ import annotations

from megatrain.ir.base import dtype_bytes
from megatrain.ir.model_ir import ModelIR

from .hardware import CAST_BYTES, Hardware
from .host_policy import POLICIES, HostPolicy, resolve
from .profile import UnitProfile, matches
from .transfers import copy_seconds

ADAMW_BYTES = {p.name: p.traffic for p in POLICIES.values()}  # host bytes per parameter of one optimizer step
COPY_BYTES = 2  # per parameter the "copy" cast's optimizer step writes besides the policy's traffic


def device_step_bytes(policy: HostPolicy, dtype: str) -> float:
    """Device-memory bytes per parameter of a device-resident unit's AdamW step (runtime/resident.py): the fp32
    master read and written (8), the fp32 gradient read (4), both moments read and written (4 x the policy's
    moment bytes), and under a bf16 compute dtype the slot's weights written (2)."""
    return 8 + 4 + 4 * policy.moment_bytes + (dtype_bytes(dtype) if dtype != "float32" else 0)


def unit_file_bytes(u, policy: HostPolicy | str) -> int:
    """Bytes of one unit's checkpoint file's tensors (runtime/checkpoint.py), what a checkpointing step's
    save_state writes (checkpoint_writes.py): fp32 masters, both moments in the policy's dtype (fp8: and their
    block scales), a fp32 step count per owned parameter, and its buffers."""
    policy = resolve(policy)
    owned = [p.numel for p in u.params if p.name not in u.tied]
    n = sum(owned)
    return 4 * n + policy.moment_state_bytes(owned, n) + 4 * len(owned) + u.buffer_bytes


def default_cast(dtype: str) -> str:
    """Where a program planned without the cast pass casts: on the host for bf16, nowhere for fp32."""
    return "none" if dtype == "float32" else "host"


def load_seconds_per_element(hw: Hardware, dtype: str, cast: str, host_share: float = 1.0) -> float:
    """Seconds per element of a load_params with the compute-dtype cast at `cast` (planner/cast.py);
    `host_share`: the fraction of the host's memory bandwidth this rank's cast may use (collectives.py)."""
    db = dtype_bytes(dtype)
    if cast == "none" or dtype == "float32":
        return db / hw.h2d_bytes_per_s
    if cast == "host":
        rate = min(hw.host_cast_rate(), hw.host_memory_bytes_per_s * host_share / CAST_BYTES) \
            if host_share < 1 else hw.host_cast_rate()
        return max(db / hw.h2d_bytes_per_s, 1 / rate)
    if cast == "gpu":
        if hw.device_cast_elements_per_s is None:
            raise ValueError(f"hardware {hw.name!r} has no device_cast_elements_per_s to price a GPU-side cast")
        return 4 / hw.h2d_bytes_per_s + 1 / hw.device_cast_elements_per_s
    if cast == "copy":
        return db / hw.h2d_bytes_per_s
    raise ValueError(f"unknown cast place {cast!r}; places: none, host, gpu, copy")


class CostModel:
    """Per-unit and per-op seconds for one (ModelIR, Hardware); `clip`: the optimizer steps with a clip factor;
    `cast`: where the compute-dtype cast runs (planner/cast.py; None: default_cast)."""

    def __init__(self, ir: ModelIR, hw: Hardware, policy: HostPolicy | str = "exact", clip: bool = False,
                 cast: str | None = None):
        self.ir, self.hw, self.policy = ir, hw, resolve(policy)
        self.cast = cast or default_cast(ir.dtype)
        flops = hw.flops(ir.dtype)
        self.index = {u.name: u.index for u in ir.units}
        self.fwd = [u.flops_fwd / flops + u.graph_nodes * hw.op_overhead_s for u in ir.units]
        self.bwd = [u.flops_bwd / flops + 2 * u.graph_nodes * hw.op_overhead_s for u in ir.units]
        per = load_seconds_per_element(hw, ir.dtype, self.cast)
        self.load = [u.flat_numel * per + hw.copy_latency_s for u in ir.units]
        gb = self.policy.grad_bytes
        self.store = [u.flat_numel * gb / hw.d2h_bytes_per_s + hw.copy_latency_s for u in ir.units]
        self.offload = [copy_seconds(u.carry_in_bytes, hw.d2h_bytes_per_s, hw) for u in ir.units]
        self.reload = [copy_seconds(u.carry_in_bytes, hw.h2d_bytes_per_s, hw) for u in ir.units]
        # a replaying unit's attention record crosses the link with a host checkpoint (models/replay.py)
        self.offload_replay = [copy_seconds(u.replay_bytes, hw.d2h_bytes_per_s, hw) for u in ir.units]
        self.reload_replay = [copy_seconds(u.replay_bytes, hw.h2d_bytes_per_s, hw) for u in ir.units]
        per_param = self.policy.traffic
        rates = hw.host_optimizer_bytes_per_s  # a clipped step's measured rate when the profile has one
        rate = rates.get(f"{self.policy.name}+clip" if clip else self.policy.name) or rates.get(
            self.policy.name, hw.host_memory_bytes_per_s)
        self.opt_rate = rate
        # "copy": the step also writes the bf16 copy, at the step's own rate (in its pass: cast_kernel.c)
        self.copy_factor = (per_param + COPY_BYTES) / per_param if self.cast == "copy" else 1.0
        self.opt = [u.n_params * per_param / rate * self.copy_factor for u in ir.units]
        self.clip = len(ir.units) * 1e-6
        # a checkpointing step's writes (checkpoint_writes.py): each unit's file at the disk's write rate plus a
        # write + fsync's fixed cost; the seal writes the small files and the manifest, and renames the folder
        self.save_bytes = [unit_file_bytes(u, self.policy) for u in ir.units]
        self.save = [b / hw.disk_write_bytes_per_s + hw.disk_file_latency_s for b in self.save_bytes]
        self.seal = 3 * hw.disk_file_latency_s
        # a resumed run's first step reads them (checkpoint_reads.py): each file at the disk's read rate, one open
        self.read = [b / hw.disk_read_bytes_per_s + hw.disk_file_latency_s for b in self.save_bytes]
        dev_rate = hw.device_memory_bytes_per_s or hw.host_memory_bytes_per_s
        self.dstep = [u.n_params * device_step_bytes(self.policy, ir.dtype) / dev_rate
                      + len(u.params) * hw.op_overhead_s for u in ir.units]
        self.norms_copy = [4 * len(u.params) / hw.d2h_bytes_per_s + hw.copy_latency_s for u in ir.units]
        self.fwd_graph, self.rebuild = list(self.fwd), list(self.fwd)
        self.recompute = [u.recompute_flops / flops + u.graph_nodes * hw.op_overhead_s for u in ir.units]
        # a recompute that replays the fused attention (models/replay.py) skips its FLOPs
        self.replay_saves = [u.attn_flops_fwd / flops if u.replay else 0.0 for u in ir.units]
        self.fwd_record, self.fwd_replay, self.norm = list(self.fwd), list(self.fwd), [0.0] * len(ir.units)
        self.dispatch_s = self.event_latency_s = self.step_gap_s = 0.0
        self.contention: dict[str, dict[str, float]] = {}
        self.measured = [False] * len(ir.units)
        # a forward or backward right after one of the same unit (a layer-major pass's later micro-batches)
        # runs with its weights in cache: measured, this fraction of the first's time
        self.warm_fwd, self.warm_bwd = [1.0] * len(ir.units), [1.0] * len(ir.units)
        if hw.units is not None and matches(hw.units, ir):
            self._measured(ir, hw.units, clip)

    def _measured(self, ir: ModelIR, prof: UnitProfile, clip: bool) -> None:
        """Price the units `prof` covers from its measurements."""
        self.dispatch_s, self.event_latency_s, self.step_gap_s = prof.dispatch_s, prof.event_latency_s, prof.step_gap_s
        self.contention = {s: dict(v) for s, v in prof.contention.items()}
        for i, u in enumerate(ir.units):
            t = prof.times_for(ir, u.template, tuple(s.shape for s in u.carry_in))
            if t is None:
                continue
            self.measured[i] = True
            self.fwd[i], self.fwd_graph[i], self.bwd[i] = t.forward_s, t.forward_graph_s, t.backward_s
            self.recompute[i] = max(0.0, t.recompute_backward_s - t.backward_s)
            if u.replay and t.replay_backward_s is not None:
                self.replay_saves[i] = max(0.0, t.recompute_backward_s - t.replay_backward_s)
                self.fwd_replay[i] = t.forward_replay_s or t.forward_s
            elif u.replay and u.recompute_flops:  # not measured: the measured recompute's attention share by FLOPs
                self.replay_saves[i] = self.recompute[i] * u.attn_flops_fwd / u.recompute_flops
            if t.rebuild_backward_s is not None:
                self.rebuild[i] = max(0.0, t.rebuild_backward_s - t.recompute_backward_s)
                self.fwd_record[i] = t.forward_rebuild_s or t.forward_s
            self.norm[i] = t.norm_s
            if t.forward_warm_s is not None and t.forward_s > 0:
                self.warm_fwd[i] = min(1.0, t.forward_warm_s / t.forward_s)
            if t.recompute_backward_warm_s is not None and t.recompute_backward_s > 0:
                self.warm_bwd[i] = min(1.0, t.recompute_backward_warm_s / t.recompute_backward_s)
            self.store[i], self.offload[i], self.reload[i] = t.store_s, t.offload_s, t.reload_s
            if self.cast in ("host", "none"):
                self.load[i] = t.load_s
            elif self.cast in t.load_cast_s:  # measured through the place's own load path
                self.load[i] = t.load_cast_s[self.cast]
            dstep = (t.device_step_clip_s if clip else t.device_step_s).get(self.policy.name)
            if dstep is not None:  # measured through the engine's device step (runtime/unit_probe.py)
                self.dstep[i] = dstep * (u.n_params / t.n_params if t.n_params else 1.0)
            if t.store_norms_s is not None:
                self.norms_copy[i] = t.store_norms_s
            opt = (t.optimizer_clip_s if clip else t.optimizer_s).get(self.policy.name)
            if opt is not None:  # a tied borrower owns fewer parameters than the unit measured
                self.opt[i] = opt * (u.n_params / t.n_params if t.n_params else 1.0) * self.copy_factor

    def backward(self, i: int, keep: bool, rebuild: bool = False, replay: bool = False) -> float:
        """Backward of unit i for one micro-batch, with the recompute of its forward unless `keep` (less its
        fused attention when it `replay`s it), and one more forward's worth to rebuild its carry-in when
        `rebuild` (its sub-layers run again)."""
        rec = 0.0 if keep else self.recompute[i] - (self.replay_saves[i] if replay else 0.0)
        return self.bwd[i] + rec + (self.rebuild[i] if rebuild else 0.0)

    def op_seconds(self, ins, sizes: dict[str, int] | None = None, warm: bool = False) -> float:
        """Seconds of one instruction (Instr or planner Op) on its stream; `warm`: a forward or backward that
        directly follows one of the same unit on the compute stream (`warm_flags`)."""
        return self._work(ins, sizes, warm) + self.dispatch_s

    def _work(self, ins, sizes: dict[str, int] | None, warm: bool = False) -> float:
        op = ins.op
        if op == "forward":
            i = self.index[ins.unit]
            t = {"keep": self.fwd_graph, "rebuild": self.fwd_record, "replay": self.fwd_replay}.get(ins.mode, self.fwd)[i]
            return t * self.warm_fwd[i] if warm else t
        if op == "backward":
            i = self.index[ins.unit]
            t = (self.backward(i, ins.source == "saved", ins.source == "rebuild", ins.source == "replay")
                 + (self.norm[i] if ins.norm else 0.0))
            return t * self.warm_bwd[i] if warm else t
        if op == "load_params":
            return self.load[self.index[ins.unit]]
        if op == "store_grads":
            return self.store[self.index[ins.unit]]
        if op in ("offload_act", "load_act"):
            i = self._carry_unit(ins.buffer)
            if i is not None and self.measured[i]:
                return self.offload[i] if op == "offload_act" else self.reload[i]
            nbytes = sizes[ins.buffer] if sizes is not None else 0
            bw = self.hw.d2h_bytes_per_s if op == "offload_act" else self.hw.h2d_bytes_per_s
            return copy_seconds(nbytes, bw, self.hw)
        if op == "optimizer_step":
            return self.opt[self.index[ins.unit]]
        if op == "clip_grads":
            return self.clip
        if op == "device_step":
            return self.dstep[self.index[ins.unit]]
        if op == "store_norms":
            return self.norms_copy[self.index[ins.unit]]
        if op == "save_state":
            return self.save[self.index[ins.unit]]
        if op == "seal_checkpoint":
            return self.seal
        if op == "load_state":
            return self.read[self.index[ins.unit]]
        return 0.0

    @staticmethod
    def warm_flags(instrs) -> list[bool]:
        """Per instruction: a forward or backward whose previous forward/backward on the compute stream was
        the same op of the same unit (so its weights are in cache)."""
        out, last = [], None
        for ins in instrs:
            cur = (ins.op, ins.unit) if ins.op in ("forward", "backward") else None
            out.append(cur is not None and cur == last)
            if cur is not None:
                last = cur
        return out

    def _carry_unit(self, buffer: str | None) -> int | None:
        """The unit whose checkpoint `carry.{unit}.{mb}` is."""
        if not buffer or not buffer.startswith("carry."):
            return None
        return self.index.get(buffer[len("carry."):].rsplit(".", 1)[0])

    def model_flops_per_step(self, n_micro: int) -> int:
        """FLOPs the model needs per step, recompute excluded (what MFU counts)."""
        return n_micro * sum(u.flops_fwd + u.flops_bwd for u in self.ir.units)
