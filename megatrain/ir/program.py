"""The schedule IR: a Program is an ordered list of instructions from a closed op set, each on a stream.

Where it sits: the planner lowers its decisions to a Program (planner/), codegen renders it as Python
(codegen/), the runtime executes it (runtime/). Every op is defined in one line in ir/README.md.

Semantics, like CUDA streams: instructions on one stream run in program order; across streams the only
ordering is `record(event)` on one stream and `wait(event)` on another. The host stream is a CPU thread
that runs the optimizer. Device memory is allocated and freed only on the compute stream (a buffer is
allocated by its first compute-stream writer, or by an explicit `alloc`; it ends at `free`), so the memory
timeline in program order of the compute stream is the timeline the device sees, exactly. Static buffers
(parameter slots, gradient slots, resident constants) live for the whole step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import IRModel

Stream = Literal["compute", "h2d", "d2h", "host", "comm", "disk"]
# offload_act / load_act of a checkpoint longer than this go in chunks of it through two pinned staging buffers
# per copy stream (runtime/staging.py), pageable host copies; the planner prices the same (planner/transfers.py).
# Shorter ones (a 70B model's 8k-token carries: 128 MiB) copy directly to their own pinned buffers.
STAGING_BYTES = 256 * 2**20
OpName = Literal[
    "alloc",
    "load_params",
    "forward",
    "offload_act",
    "load_act",
    "backward",
    "store_grads",
    "optimizer_step",
    "clip_grads",
    "device_step",
    "store_norms",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "save_state",
    "seal_checkpoint",
    "load_state",
    "record",
    "wait",
    "free",
]
BufferKind = Literal["param_slot", "grad_slot", "resident", "batch", "loss", "carry", "saved", "grad_carry",
                     "attention", "cast_stage", "device_state"]
# Where a bf16 program's load_params gets the compute-dtype weights (planner/cast.py decides, runtime/cast.py runs):
# cast on the host into pinned staging, cast on the device from fp32 that crossed the link (the `cast` buffer), or
# a persistent bf16 copy the optimizer writes; fp32 programs cast nothing.
CastPlace = Literal["none", "host", "gpu", "copy"]

# The stream each op may run on; record/wait/free name their stream explicitly.
OP_STREAMS: dict[str, tuple[str, ...]] = {
    "alloc": ("compute",),
    "load_params": ("h2d",),
    "forward": ("compute",),
    "offload_act": ("d2h",),
    "load_act": ("h2d",),
    "backward": ("compute",),
    "store_grads": ("d2h",),
    "optimizer_step": ("host",),
    "clip_grads": ("host",),
    "device_step": ("compute",),
    "store_norms": ("d2h",),
    "all_gather": ("comm",),
    "reduce_scatter": ("comm",),
    "all_reduce": ("comm",),
    # a checkpointing step's writes (planner/checkpoint_writes.py): a host thread of their own, so a slow disk
    # holds back neither the optimizer nor the copies
    "save_state": ("disk",),
    "seal_checkpoint": ("disk",),
    # a resumed run's first step reads the checkpoint on the same thread (planner/checkpoint_reads.py)
    "load_state": ("disk",),
    "record": ("compute", "h2d", "d2h", "host", "comm", "disk"),
    "wait": ("compute", "h2d", "d2h", "host", "comm", "disk"),
    "free": ("compute",),
}


class Buffer(IRModel):
    """A named device buffer. Host-side copies (offloaded checkpoints) are named `host:<buffer>`."""

    name: str
    kind: BufferKind
    nbytes: int = Field(ge=0)
    static: bool = Field(description="allocated for the whole step (slots, resident constants)")
    unit: str | None = Field(None, description="the unit whose data it holds, for dynamic buffers")
    mb: int | None = None


def checkpoint_tensors(ir, buffer: Buffer) -> tuple:
    """The tensors (TensorSpecs) an offloadable checkpoint buffer holds: a carry's are its unit's carry-in, an
    attention record's (kind "attention") the unit's `replay` (models/replay.py). `ir`: the ModelIR."""
    u = ir.unit(buffer.unit)
    return u.replay if buffer.kind == "attention" else u.carry_in


# What a forward keeps for its backward, one mode per forward (the checkpoint placement the planner chose, ir/README.md):
# plain (its carry-in is the checkpoint), keep (also its autograd graph: `saved`), rebuild (the sub-layer inputs that
# rebuild the carry-in: `side`), replay (the fused attention's outputs its recompute replays: `attn`), eval (an
# evaluation's forward: inference mode, no backward follows, nothing recorded). A placement is one of these, so
# they never combine.
ForwardMode = Literal["plain", "keep", "rebuild", "replay", "eval"]
# Where a backward gets the graph it back-propagates through, matching its forward's mode: recompute (from the
# checkpoint), saved (the kept graph), rebuild (rebuild the carry-in first, then recompute), replay (recompute
# taking the fused attention's outputs from `attn`).
BackwardSource = Literal["recompute", "saved", "rebuild", "replay"]
# The source of the backward of each training forward mode.
SOURCE_OF: dict[str, str] = {"plain": "recompute", "keep": "saved", "rebuild": "rebuild", "replay": "replay"}

# The operands of each op, in the order it prints and the engine's method takes them; any other operand field must
# keep its default (the validator's rule). reads/writes/workspace_bytes describe every op for the verifier.
OPERANDS: dict[str, tuple[str, ...]] = {
    "alloc": ("buffer",),
    "load_params": ("unit", "slot", "shard"),
    "forward": ("unit", "slot", "mb", "mode"),
    "offload_act": ("buffer",),
    "load_act": ("buffer",),
    "backward": ("unit", "slot", "grad_slot", "mb", "source", "accumulate", "norm"),
    "store_grads": ("unit", "grad_slot", "host_grad", "shard"),
    "optimizer_step": ("unit", "host_grad"),
    "clip_grads": (),
    "device_step": ("unit", "slot", "grad_slot"),
    "store_norms": ("unit", "grad_slot"),
    "all_gather": ("unit", "slot"),
    "reduce_scatter": ("unit", "grad_slot"),
    "all_reduce": ("unit", "grad_slot"),
    "save_state": ("unit",),
    "seal_checkpoint": (),
    "load_state": ("unit",),
    "record": ("event",),
    "wait": ("event",),
    "free": ("buffer",),
}
_DEFAULTS = {"forward": {"mode": "plain"}, "backward": {"source": "recompute"}}


class Instr(IRModel):
    """One instruction. `reads`/`writes` name the buffers it touches; the verifier checks them."""

    op: OpName
    stream: Stream
    unit: str | None = None
    mb: int | None = None
    slot: int | None = Field(None, description="parameter slot index (load_params, forward, backward, all_gather)")
    grad_slot: int | None = Field(None, description="gradient slot index (backward, store_grads, collectives)")
    event: str | None = Field(None, description="event name (record, wait)")
    buffer: str | None = Field(None, description="the buffer of alloc/free/offload_act/load_act")
    mode: ForwardMode | None = Field(None, description="forward: what it keeps for its backward (default plain)")
    source: BackwardSource | None = Field(
        None, description="backward: where the graph it back-propagates through comes from (default recompute)")
    accumulate: bool = Field(False, description="backward: add into the gradient slot instead of overwriting")
    norm: bool = Field(
        False, description="backward: the unit's gradients are final after it (its last micro-batch); also write "
        "their per-parameter L2 norms (fp32) into the gradient slot after the gradients"
    )
    host_grad: int | None = Field(
        None, ge=0, description="store_grads / optimizer_step: the host gradient buffer `hgrad{k}` the unit's "
        "gradients land in and are stepped from (None: the unit's own buffer)"
    )
    shard: bool = Field(
        False, description="load_params / store_grads of a sharded unit in a world program: only this rank's shard "
        "of the unit's flat buffer crosses the link (all_gather completes the slot, reduce_scatter made the shard)"
    )
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    workspace_bytes: int = Field(0, ge=0, description="transient device bytes while this op runs")

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data):
        if isinstance(data, dict):
            for name, value in _DEFAULTS.get(data.get("op"), {}).items():
                if data.get(name) is None:
                    data = {**data, name: value}
        return data

    @model_validator(mode="after")
    def _stream_allowed(self) -> Instr:
        if self.stream not in OP_STREAMS[self.op]:
            raise ValueError(f"op {self.op} cannot run on stream {self.stream}; allowed: {OP_STREAMS[self.op]}")
        if self.op in ("record", "wait") and not self.event:
            raise ValueError(f"{self.op} needs an event name")
        if self.op in ("alloc", "free", "offload_act", "load_act") and not self.buffer:
            raise ValueError(f"{self.op} needs a buffer name")
        for name in _OPERAND_FIELDS - set(OPERANDS[self.op]):
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{self.op} takes no {name} (given {getattr(self, name)!r}); its operands: "
                                 f"{', '.join(OPERANDS[self.op]) or 'none'}")
        if self.workspace_bytes and self.op not in ("forward", "backward", "device_step"):
            raise ValueError(f"{self.op} has no workspace; only forward, backward and device_step do")
        return self

    def operands(self) -> list[tuple[str, object]]:
        """(name, value) of the operands that differ from their defaults, in OPERANDS order: what prints, and
        what codegen passes to the engine (codegen/emit.py)."""
        return [(name, v) for name in OPERANDS[self.op]
                if (v := getattr(self, name)) is not None and v is not False and v != _DEFAULTS.get(self.op, {}).get(name)]

    def __str__(self) -> str:
        return f"[{self.stream:>7}] {self.op}({', '.join(f'{k}={v}' for k, v in self.operands())})"


_OPERAND_FIELDS = {name for names in OPERANDS.values() for name in names}


class Program(IRModel):
    """One optimizer step (`purpose` step), or one evaluation pass over validation batches (`eval`,
    planner/evaluation.py): buffers, then instructions in program order."""

    purpose: Literal["step", "eval"] = "step"
    n_micro_batches: int = Field(ge=0, description="micro-batches this rank runs per step (an evaluation: the "
                                 "validation batches it runs, none on a rank that has none)")
    world_size: int = Field(1, ge=1, description="ranks running this program together (data parallel); each "
                            "runs n_micro_batches of the global step's world_size x n_micro_batches")
    buffers: tuple[Buffer, ...]
    instrs: tuple[Instr, ...]
    cast: CastPlace | None = Field(None, description="where load_params' compute-dtype cast runs (planner/cast.py); "
                                   "None: planned without the cast pass, so on the host for bf16 (none for fp32)")

    @model_validator(mode="after")
    def _names_known(self) -> Program:
        if self.purpose == "step" and self.n_micro_batches < 1:
            raise ValueError("a step program runs at least one micro-batch")
        names = {b.name for b in self.buffers}
        if len(names) != len(self.buffers):
            raise ValueError("buffer names must be unique")
        for i, ins in enumerate(self.instrs):
            for ref in (*ins.reads, *ins.writes, *((ins.buffer,) if ins.buffer else ())):
                base = ref.removeprefix("host:")
                if base not in names:
                    raise ValueError(f"instruction {i} ({ins}) names unknown buffer {ref!r}")
        return self

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name.removeprefix("host:"):
                return b
        raise KeyError(name)

    def on(self, stream: str) -> list[tuple[int, Instr]]:
        """(program index, instruction) pairs of one stream, in order."""
        return [(i, ins) for i, ins in enumerate(self.instrs) if ins.stream == stream]

    def __str__(self) -> str:
        return "\n".join(f"{i:5d} {ins}" for i, ins in enumerate(self.instrs))


def resident_units(program: Program) -> dict[str, str]:
    """unit -> "weights" or "device" for every unit whose state place is not the host's (issue 40): a unit
    stepped by `device_step` lives on the device; one holding a dedicated parameter slot (a param_slot buffer
    naming it) without a device step keeps only its weights there. Units absent are streamed as usual."""
    out = {b.unit: "weights" for b in program.buffers if b.kind == "param_slot" and b.unit is not None}
    out.update({ins.unit: "device" for ins in program.instrs if ins.op == "device_step"})
    return out
