"""Measured unit profiles: what each instruction of a plan costs on the device that will run it.

Where it sits: `megatrain probe --model M ...` (runtime/unit_probe.py) measures a UnitProfile and caches it;
the Hardware profile carries it (`Hardware.units`) and the cost model (costs.py) prices every op of a unit
whose template it holds from it instead of the roofline; `train --hardware auto` picks a cached one up.
Try it: `megatrain probe --device cpu --model tiny --seq-len 64 --micro-batch 2 --dtype fp32`.

What is measured, per distinct unit template at the planned micro-batch, sequence length and compute dtype,
on the device (the sim device's stream workers with the thread settings a run uses, or CUDA streams): every
op the engine runs for it, through the engine's own code (forward without and with its autograd graph,
backward from the graph and recomputing, the norm pass, a rebuild where the unit can, its parameter load and
gradient store at slot size (bf16: the load from each place of the compute-dtype cast, planner/cast.py), a checkpoint's offload and reload), the host optimizer step of the unit at its
real size under the host policy (with and without a clip factor), and for the device as a whole the cost of one
instruction on a stream (`dispatch_s`), the wake-up of a stream waiting on another's event
(`event_latency_s`), the gap between one step's compute and the next step's first instruction (the
Python of the training loop: `step_gap_s`), and how much each stream's ops slow down while another stream is
busy (`contention`, planner/contention.py). Times are medians of interleaved repeats.

Keys: a profile is valid for one (device, model shape, micro-batch, sequence length, dtype, packing, loss
chunk, thread settings, compile mode) and one torch version; `profile_key` hashes them. The cache holds one
Hardware JSON (the machine's figures and this UnitProfile) per key under $MEGATRAIN_CACHE/profiles (default
~/.cache/megatrain/profiles; MEGATRAIN_PROFILES overrides the folder); a file that does not parse or
validate, or whose key does not match, is ignored (profile_cache.py `read_cached` returns None), so a probe
measures it again.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from megatrain.ir.base import IRModel
from megatrain.ir.model_ir import ModelIR

PROFILE_VERSION = 11  # 2: warm repeats of forward and recompute-backward; 3: the one-pass host optimizer's rates;
# 4: attention replay's forward and backward; 5: kept graphs timed as a pass (unit_probe.PASS_BYTES); 6: contention
# as the median of paired ratios over unit_probe.CONTENTION_ROUNDS, the host kernel's prefetch and clip multiply;
# 7: the host kernel's AVX-512 fp8 loop (fp8's rate); 8: fp8's one-division update (fp8's rate); 9: fp8's codes
# through fp16 and fused update (fp8's rate); 10: loads per place of the compute-dtype cast (`load_cast_s`), the
# host cast in C (runtime/cast_kernel.c); 11: a device-resident unit's device step and norm store (issue 40)


class UnitTimes(IRModel):
    """Seconds of each op of one unit template on its stream, for one micro-batch."""

    template: str
    carry_in: tuple[tuple[int, ...], ...] = Field(description="carry-in shapes it was measured with")
    n_params: int = Field(ge=0, description="parameters the measured unit owns (its optimizer step's size)")
    forward_s: float = Field(ge=0, description="forward without autograd (checkpoint on device or host)")
    forward_warm_s: float | None = Field(None, ge=0, description="forward again right after one of its own: "
                                         "a later micro-batch of a layer-major pass, weights in cache")
    forward_graph_s: float = Field(ge=0, description="forward keeping its autograd graph (mode keep)")
    backward_s: float = Field(ge=0, description="backward from the kept graph, gradients written")
    recompute_backward_s: float = Field(ge=0, description="backward recomputing the forward from the checkpoint")
    recompute_backward_warm_s: float | None = Field(None, ge=0, description="the same right after one of its own")
    forward_rebuild_s: float | None = Field(None, ge=0, description="forward recording what a rebuild needs")
    rebuild_backward_s: float | None = Field(None, ge=0, description="backward rebuilding its carry-in first")
    forward_replay_s: float | None = Field(None, ge=0, description="forward keeping its attention record")
    replay_backward_s: float | None = Field(None, ge=0, description="backward whose recompute replays attention")
    norm_s: float = Field(ge=0, description="what `norm` (per-parameter gradient norms) adds to a backward")
    load_s: float = Field(ge=0, description="load_params: its weights (and buffers) into a slot (bf16: cast on "
                          "the host, the default place of the compute-dtype cast)")
    load_cast_s: dict[str, float] = Field(default_factory=dict, description="bf16: load_params with the cast at "
                                          "another place of planner/cast.py ('gpu', 'copy')")
    store_s: float = Field(ge=0, description="store_grads: its gradients and norms to the host")
    offload_s: float = Field(0.0, ge=0, description="offload_act of its carry-in checkpoint")
    reload_s: float = Field(0.0, ge=0, description="load_act of its carry-in checkpoint")
    optimizer_s: dict[str, float] = Field(description="host policy -> optimizer_step of the unit, no clipping")
    optimizer_clip_s: dict[str, float] = Field(description="host policy -> optimizer_step with a clip factor < 1")
    device_step_s: dict[str, float] = Field(default_factory=dict, description="host policy -> device_step of the "
                                            "unit with its state on the device (no clipping)")
    device_step_clip_s: dict[str, float] = Field(default_factory=dict, description="host policy -> device_step "
                                                 "with a clip factor < 1")
    store_norms_s: float | None = Field(None, ge=0, description="store_norms: a device unit's per-parameter "
                                        "gradient norms to the host")


class UnitProfile(IRModel):
    """Measured op costs of one model shape on one device (see the module docstring)."""

    version: int = PROFILE_VERSION
    key: str = Field(description="profile_key of the fields below: what a lookup matches")
    device: str = Field(description="sim or cuda")
    device_name: str = Field(description="the CPU or GPU model measured")
    torch: str
    model: str
    config_sha: str = Field(description="sha256 of the model config (its shape), name excluded")
    micro_batch: int
    seq_len: int
    dtype: str
    packed: bool = False
    loss_chunk: int = 1024
    threads: dict[str, int] = Field(default_factory=dict, description="sim: intra-op threads per stream")
    compiled: bool = Field(False, description="units run through torch.compile")
    dispatch_s: float = Field(ge=0, description="one instruction on a stream beyond its work")
    event_latency_s: float = Field(ge=0, description="a stream blocked on another stream's event wakes this late")
    step_gap_s: float = Field(ge=0, description="from a step's compute end to the next step's first instruction")
    contention: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="stream -> other stream -> how much slower an op of the first runs "
        "while the second is busy (>= 1; planner/contention.py)")
    units: dict[str, UnitTimes] = Field(description="template -> its op times")
    repeats: int = 0
    seconds: float = Field(0.0, description="how long the probe took")
    measured_at: str = ""
    spread: dict[str, float] = Field(default_factory=dict, description="the op whose timed rounds disagreed most "
                                     "('template op') -> its interquartile range over its median")

    def times_for(self, ir: ModelIR, template: str, carry_in: tuple[tuple[int, ...], ...]) -> UnitTimes | None:
        """The measured times of `template` if this profile was measured for `ir`'s shape, else None."""
        if not matches(self, ir):
            return None
        t = self.units.get(template)
        return t if t is not None and t.carry_in == carry_in else None


def config_sha(config: dict) -> str:
    """The model's shape: its config without the name."""
    data = {k: v for k, v in config.items() if k != "name"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def ir_identity(ir: ModelIR) -> dict:
    """What of a ModelIR a profile must match."""
    return {"config_sha": config_sha(ir.config), "micro_batch": ir.micro_batch, "seq_len": ir.seq_len,
            "dtype": ir.dtype, "packed": ir.packed}


def profile_key(*, device: str, device_name: str, torch: str, config_sha: str, micro_batch: int, seq_len: int,
                dtype: str, packed: bool, loss_chunk: int, threads: dict[str, int], compiled: bool) -> str:
    data = {"version": PROFILE_VERSION, "device": device, "device_name": device_name, "torch": torch,
            "config_sha": config_sha, "micro_batch": micro_batch, "seq_len": seq_len, "dtype": dtype,
            "packed": packed, "loss_chunk": loss_chunk, "threads": dict(sorted(threads.items())),
            "compiled": compiled}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def key_of(p: UnitProfile) -> str:
    return profile_key(device=p.device, device_name=p.device_name, torch=p.torch, config_sha=p.config_sha,
                       micro_batch=p.micro_batch, seq_len=p.seq_len, dtype=p.dtype, packed=p.packed,
                       loss_chunk=p.loss_chunk, threads=p.threads, compiled=p.compiled)


def matches(p: UnitProfile, ir: ModelIR) -> bool:
    return all(getattr(p, k) == v for k, v in ir_identity(ir).items())
