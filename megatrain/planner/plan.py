"""Plan: the planner's output, a frozen pydantic value that round-trips through JSON.

Where it sits: `plan()` returns it; codegen renders `plan.program`; the runtime executes it; the CLI prints
it (display.py). Try it: `megatrain plan --model tiny --hardware cpu --seq-len 128 --micro-batch 2`.

`peak_gpu_bytes` = hardware.reserved_bytes + ceil(peak x (1 + allocator_margin)), where peak is the largest
value of the memory timeline: live Program buffers (static and dynamic) plus the workspace of the running
forward/backward. `peak_buffer_bytes` is the buffers alone, which a sim device's pool measures exactly.
`host_bytes` = what the host allocates for the step under `host_policy` (host_policy.py `host_layout`), to the
byte: fp32 masters (4 per flat element), AdamW moments in the policy's dtype and their step counts, the host
gradient buffers the program's store_grads land in (a ring for units stepped as they land, one per waiting
unit), per-parameter gradient norms, the bf16 staging ring the link is fed from (or, with the `copy` cast,
a bf16 copy of every master: cast.py), unit buffers (MoE), host
checkpoints (every offloaded carry tensor, a pool reused each step: pinned at its exact size, or pageable for
one longer than a staging chunk), the pinned staging buffers those longer ones cross through
(runtime/staging.py: 4 x 256 MiB, when any), and the pinned region's alignment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatrain.ir.base import IRModel
from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Program

from .hardware import Hardware
from .train import TrainSpec
from .world import World

Bottleneck = Literal["compute", "h2d", "d2h", "host_optimizer", "collectives"]


class PassRecord(IRModel):
    """One planner pass: its name, what it decided (human lines) and how long it took."""

    name: str
    decisions: tuple[str, ...]
    seconds: float


class UnitPlan(IRModel):
    """Per-unit decisions and predictions, per optimizer step (all micro-batches)."""

    name: str
    kind: str
    params: int
    placement: Literal["device", "host", "keep", "rebuild"]
    replay: bool = Field(False, description="its checkpoint also keeps the fused attention's outputs, which its "
                         "recompute replays (models/replay.py)")
    slot: int
    grad_slot: int
    resident: bool = Field(description="stays in its slot from forward to backward (no reload)")
    state: Literal["host", "weights", "device"] = Field(
        "host", description="where its state lives: host (streamed), weights (its compute-dtype weights stay on "
        "the device, the optimizer on the host), device (weights, gradient and AdamW state on the device, "
        "stepped there)")
    checkpoint_bytes: int = Field(description="device or host bytes of its checkpoints (keep: + saved graph; "
                                  "replay: + the attention records)")
    forward_s: float
    backward_s: float = Field(description="backward including the recompute of the forward unless kept")
    h2d_s: float = Field(description="parameter loads plus checkpoint reloads")
    d2h_s: float = Field(description="gradient store plus checkpoint offloads")
    optimizer_s: float


class Plan(IRModel):
    """Decisions, the Program, and what the planner predicts for it."""

    ir: ModelIR
    hardware: Hardware
    train: TrainSpec = Field(description="the global step: with a world, every rank's micro-batches together")
    world: World = Field(World(), description="the data-parallel ranks; the Program is one rank's step")
    gpu_budget_bytes: int
    program: Program
    passes: tuple[PassRecord, ...]
    n_slots: int
    prefetch_distance: int
    n_grad_slots: int
    slot_bytes: int
    grad_slot_bytes: int
    placement: dict[str, Literal["device", "host", "keep", "rebuild"]]
    state_place: dict[str, Literal["host", "weights", "device"]] = Field(
        default_factory=dict, description="per unit, where its state lives (the residency pass; UnitPlan.state)")
    resident_units: tuple[str, ...] = Field((), description="units whose state place is not host, forward order")
    units: tuple[UnitPlan, ...]
    peak_gpu_bytes: int = Field(description="reserved + (buffers + workspace peak) x (1 + allocator margin)")
    peak_device_bytes: int = Field(description="peak of buffers + workspace, before reserve and margin")
    peak_buffer_bytes: int = Field(description="peak of Program buffers alone (what the sim device measures)")
    peak_at: str = Field(description="the instruction at the peak")
    memory_timeline: tuple[int, ...] = Field(description="buffers + workspace per compute-stream instruction")
    host_bytes: int = Field(description="host bytes allocated for the step, exactly (host_policy.host_layout)")
    host_breakdown: dict[str, int]
    host_bytes_per_rank: tuple[int, ...] = Field((), description="host bytes of each rank's share, exactly "
                                                 "(host_bytes is the largest)")
    host_bytes_per_node: int = Field(0, description="host bytes of the node holding the most: its ranks' shares")
    collectives_s: float = Field(0.0, description="seconds of collectives one rank issues per step (comm stream)")
    host_policy: str = Field("exact", description="how the host holds the state (host_policy.POLICIES)")
    host_policy_reason: str = Field("", description="why the host_policy pass chose it")
    cast: Literal["none", "host", "gpu", "copy"] = Field(
        "none", description="where the compute-dtype cast feeding the loads runs (cast.py; the Program's cast)")
    cast_elements_per_s: float | None = Field(None, description="the rate that cast is priced at, elements/s")
    cast_reason: str = Field("", description="why the cast pass chose it")
    cast_step_s: dict[str, float] = Field(default_factory=dict, description="the predicted step under each place "
                                          "the budgets allow")
    step_time_s: float
    first_step_s: float
    time_to_first_step_s: float = Field(0.0, description="seconds to create the host store before the first step: "
                                        "first touch of host_bytes and the initial weights (creation.py)")
    tokens_per_s: float
    model_tflops: float = Field(description="model FLOPs per step (recompute excluded) / step time, in TFLOP/s")
    mfu: float = Field(description="model FLOP/s over the nominal dense peak of the compute dtype")
    bottleneck: Bottleneck
    bottleneck_share: float
    critical_path_s: dict[str, float] = Field(description="seconds per resource on the steady-state critical path")
    busy_s: dict[str, float] = Field(description="seconds each resource works per step")
    compute_bound_tokens_per_s: float = Field(description="tokens/s if compute ran alone, without recompute")
    link_bound_tokens_per_s: float = Field(description="tokens/s if each unit crossed h2d and d2h once (a unit "
                                           "whose state lives on the device does not cross)")
    planner_seconds: float

    @property
    def state_bytes_per_param(self) -> float:
        """Host bytes per parameter before checkpoints (and their staging): state, gradient buffers, norms, the
        transfer staging ring."""
        ckpt = self.host_breakdown.get("checkpoints", 0) + self.host_breakdown.get("checkpoint_staging", 0)
        return (self.host_bytes - ckpt) / max(1, self.ir.params_total)

    @property
    def feasible(self) -> bool:
        return self.peak_gpu_bytes <= self.gpu_budget_bytes

    def summary(self) -> dict:
        """The machine-readable summary that `megatrain plan --json` prints."""
        return {
            "feasible": self.feasible, "model": self.ir.model, "hardware": self.hardware.name,
            "micro_batch": self.train.micro_batch, "seq_len": self.train.seq_len,
            "grad_accum": self.train.grad_accum, "dtype": self.train.dtype,
            "peak_gpu_bytes": self.peak_gpu_bytes, "gpu_budget_bytes": self.gpu_budget_bytes,
            "peak_buffer_bytes": self.peak_buffer_bytes, "peak_device_bytes": self.peak_device_bytes,
            "host_bytes": self.host_bytes, "host_memory_bytes": self.hardware.host_memory_bytes,
            "host_breakdown": self.host_breakdown, "params": self.ir.params_total,
            "world": {"nproc": self.world.nproc, "nnodes": self.world.nnodes,
                      "host_bytes_per_rank": list(self.host_bytes_per_rank),
                      "host_bytes_per_node": self.host_bytes_per_node, "collectives_s": self.collectives_s},
            "host_policy": {"name": self.host_policy, "bytes_per_param": self.state_bytes_per_param,
                            "reason": self.host_policy_reason},
            "cast": {"where": self.cast, "elements_per_s": self.cast_elements_per_s, "reason": self.cast_reason,
                     "step_time_s": self.cast_step_s},
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "time_to_first_step_s": self.time_to_first_step_s,
            "model_tflops": self.model_tflops, "mfu": self.mfu, "bottleneck": self.bottleneck,
            "bottleneck_share": self.bottleneck_share, "critical_path_s": self.critical_path_s,
            "compute_bound_tokens_per_s": self.compute_bound_tokens_per_s,
            "link_bound_tokens_per_s": self.link_bound_tokens_per_s,
            "n_slots": self.n_slots, "prefetch_distance": self.prefetch_distance,
            "n_grad_slots": self.n_grad_slots, "n_instructions": len(self.program.instrs),
            "resident_units": list(self.resident_units), "state_place": self.state_place,
            "chunk_tokens": self.ir.chunk_tokens, "traced_seq_len": self.ir.traced_seq_len,
            "planner_seconds": self.planner_seconds,
            "units": [u.model_dump() for u in self.units],
        }
