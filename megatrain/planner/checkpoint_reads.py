"""A resume read while the first step trains: the resume program, its rules and its price.

Where it sits: the mirror image of checkpoint_writes.py. The Trainer runs the program `resume_program(step, ir)`
returns for the first step after a resume (runtime/checkpoint_stream.py's `load_state` runs its reads;
runtime/checkpointer.py `streamed_resume` decides), then the step program as usual; `megatrain plan
--checkpoint-every N` prints `resume_cost`'s line beside the checkpoint's. Try it:
`pytest tests/planner/test_checkpoint_reads.py -q`.

The first step after a resume is the step program plus the reads of the checkpoint's unit files on the `disk`
stream (a host thread of its own), first in program order:
- disk: per unit, in the order the step first touches its host state (forward order: the loads of the units'
  weights), `load_state(u)` and `record(resume.loaded.u)`;
- every other stream: `wait(resume.loaded.u)` before its first instruction that reads or writes u's host state
  (`state_units`: `load_params` of u or of a unit holding a tied copy of u's parameters, `optimizer_step(u)`, and
  `clip_grads`, whose overflow check reads every unit's masters and step counts), unless the stream already
  waited on the load of u or of a unit read after it (the disk reads in order).
So the first forward starts once the embedding's file is in, not once the whole model's is: at 120B the files
are ~1.4 TB, minutes at NVMe rates, and the step hides them behind its own transfers and compute where the disk
keeps ahead of the loads (the price says how much it does).

Units whose state lives on the device (runtime/resident.py, a `device_step`) are not streamed: their state is
uploaded at the step's start, so the Trainer reads their files before the first step. A data-parallel world's
checkpoint (runtime/sharded_checkpoint.py: shards resharded on load across ranks) is read before the first step
too: `resume_program` refuses a world program.

A resume program runs once, after the device was made: a device's first step treats the previous step's events
as done, and the disk records come first so they set that step (runtime/stream_device.py), and nothing before it
writes the state its loads overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Instr, Program, resident_units

from .checkpoint_writes import step_besides
from .sync import tied_owners

LOADED = "resume.loaded."


class ResumePlanError(ValueError):
    """A step program whose first step cannot read its checkpoint while it trains."""


def loaded_event(unit: str) -> str:
    return LOADED + unit


def _units(program: Program, ir: ModelIR | None) -> list[str]:
    """Every unit of the model: the IR's, else those the program's instructions name (disk ones left out)."""
    if ir is not None:
        return [u.name for u in ir.units]
    return list(dict.fromkeys(ins.unit for ins in program.instrs if ins.unit is not None and ins.stream != "disk"))


def state_units(ins: Instr, owners: dict[str, list[str]], units: list[str]) -> tuple[str, ...]:
    """The units whose host state (fp32 master, moments, step counts, buffers) instruction `ins` reads or
    writes, owners of tied parameters first: a load reads its unit's masters and buffers and its tied owners'
    masters, an optimizer step reads and writes its unit's, clip_grads reads every unit's (its overflow verdict
    takes the masters' norms and the step counts, runtime/verdict.py). The device's ops (forward, backward,
    device_step) touch device memory only; store_grads and store_norms write gradients and norms, not state."""
    if ins.stream == "disk":
        return ()
    if ins.op == "load_params":
        return (*owners.get(ins.unit, ()), ins.unit)
    if ins.op == "optimizer_step":
        return (ins.unit,)
    if ins.op == "clip_grads":
        return tuple(units)
    return ()


def device_units(program: Program) -> list[str]:
    """Units whose state lives on the device (ir/program.py `resident_units`): read before the first step, not
    streamed."""
    return [u for u, place in resident_units(program).items() if place == "device"]


def resume_program(step: Program, ir: ModelIR | None = None) -> Program:
    """The first step after a resume beside step program `step`: the same instructions, plus the reads of every
    unit's checkpoint file (but those whose state lives on the device) on the disk stream and the waits that
    keep each reader of a unit's host state behind its read. `ir` names the tied parameters (without it a tied
    owner is read where the step first touches it, which is the embedding's place in a transformer)."""
    if step.purpose != "step":
        raise ResumePlanError(f"a resume step is planned beside a step program, not a {step.purpose} one")
    if step.world_size > 1:
        raise ResumePlanError(f"a world of {step.world_size} ranks resumes from a sharded checkpoint, resharded "
                              "across ranks as it is read: it is read before the first step")
    if any(ins.stream == "disk" for ins in step.instrs):
        raise ResumePlanError("the program already has disk instructions (it writes or reads a checkpoint)")
    owners = tied_owners(ir) if ir is not None else {}
    units, device = _units(step, ir), set(device_units(step))
    order: list[str] = []
    for ins in step.instrs:  # the order the step first touches each unit's host state
        order += [u for u in state_units(ins, owners, units) if u not in device and u not in order]
    order += [u for u in units if u not in device and u not in order]  # read by nothing in the step: last
    if not order:
        raise ResumePlanError("every unit's state lives on the device: there is nothing to read while the step "
                              "trains")
    at = {u: k for k, u in enumerate(order)}
    disk = [x for u in order for x in (Instr(op="load_state", stream="disk", unit=u),
                                       Instr(op="record", stream="disk", event=loaded_event(u)))]
    waited: dict[str, int] = {}  # per stream: the last load it waited on (the disk reads in order)
    body: list[Instr] = []
    for ins in step.instrs:
        need = max((at[u] for u in state_units(ins, owners, units) if u in at), default=-1)
        if need > waited.get(ins.stream, -1):
            body.append(Instr(op="wait", stream=ins.stream, event=loaded_event(order[need])))
            waited[ins.stream] = need
        body.append(ins)
    return step.replace(instrs=(*disk, *body))


def check_resume_pair(step: Program, first: Program) -> list[str]:
    """Problems with `first` as the resume step of `step` (one line each; empty: none): it must be `step` plus
    the disk stream's reads and the waits on them, so the step program may follow it."""
    rest = tuple(ins for ins in first.instrs
                 if ins.stream != "disk" and not (ins.op == "wait" and ins.event.startswith(LOADED)))
    return step_besides(step, first, rest, "the resume step", "reads", "the step program must be able to follow it")


def check_reads(program: Program, hb, at, ir: ModelIR | None = None) -> list[str]:
    """The verifier's rules for a program that reads a checkpoint (verify.py; `hb` its happens-before, `at` its
    instruction label): one load_state per unit whose state lives on the host, none of a unit stepped on the
    device, each before every instruction that reads or writes the unit's host state (`state_units`), and no
    checkpoint written by the same program."""
    instrs = program.instrs
    loads = [(i, ins) for i, ins in enumerate(instrs) if ins.op == "load_state"]
    if not loads:
        return []
    problems = []
    if any(ins.op in ("save_state", "seal_checkpoint") for ins in instrs):
        problems.append("a program both reads and writes a checkpoint: a resume's first step writes none")
    device = set(device_units(program))
    seen: dict[str, int] = {}
    for i, ins in loads:
        if ins.unit in seen:
            problems.append(f"{at(i, ins)} reads {ins.unit} a second time (first at instruction {seen[ins.unit]})")
        elif ins.unit in device:
            problems.append(f"{at(i, ins)} reads {ins.unit}, whose state lives on the device: it is read before "
                            "the first step, which uploads it")
        else:
            seen[ins.unit] = i
    owners = tied_owners(ir) if ir is not None else {}
    units = _units(program, ir)
    for j, ins in enumerate(instrs):
        for u in state_units(ins, owners, units):
            i = seen.get(u)
            if i is not None and not hb.before((1, i), (1, j)):
                problems.append(f"{at(j, ins)} may touch {u}'s host state before {at(i, instrs[i])} has read it "
                                "(missing wait)")
    problems += [f"no load_state({u}): the resumed state would miss {u}" for u in units
                 if u not in device and u not in seen]
    return problems


# -- the price -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResumeCost:
    bytes: int  # of the unit files the first step reads while it trains
    before_bytes: int  # of those read before it: the units whose state lives on the device
    read_s: float  # the disk stream's busy time: every load_state
    before_s: float  # the reads before the first step
    streamed_s: float  # from the end of the manifest's checks to the end of the first step, streaming
    synchronous_s: float  # the same, every file read first
    disk_bytes_per_s: float

    @property
    def saved_s(self) -> float:
        return max(0.0, self.synchronous_s - self.streamed_s)

    def line(self) -> str:
        from .bytesize import format_bytes

        before = (f"; {format_bytes(self.before_bytes)} of units whose state lives on the device read before it"
                  if self.before_bytes else "")
        return (f"resume: {format_bytes(self.bytes)} read at {self.disk_bytes_per_s / 1e9:.3g} GB/s (the hardware's "
                f"disk_read_bytes_per_s) in {self.read_s:.3g} s while the first step trains{before}; the first step "
                f"ends after {self.streamed_s:.4g} s against {self.synchronous_s:.4g} s reading everything first "
                f"(-{self.saved_s:.4g} s)")


def resume_cost(plan) -> ResumeCost:
    """The price of a resume under `plan`: the first step's predicted end streaming the checkpoint in, against
    reading every unit file first and then running the step, both with the same cost model (estimate.py).
    Raises ResumePlanError where the plan reads it before the first step (a world)."""
    from .collectives import cost_model
    from .estimate import estimate_time

    step = plan.program
    first = resume_program(step, plan.ir)
    clip = any(ins.op == "clip_grads" for ins in step.instrs)
    costs = cost_model(plan.ir, plan.hardware, plan.host_policy, clip, None, plan.cast)
    plain, streamed = estimate_time(step, costs), estimate_time(first, costs)
    read = sum(d for d, ins in zip(streamed.duration_s, first.instrs) if ins.op == "load_state")
    nbytes = sum(costs.save_bytes[costs.index[ins.unit]] for ins in first.instrs if ins.op == "load_state")
    device = device_units(step)
    before_s = sum(costs.read[costs.index[u]] for u in device)
    return ResumeCost(bytes=nbytes, before_bytes=sum(costs.save_bytes[costs.index[u]] for u in device),
                      read_s=read, before_s=before_s, streamed_s=before_s + streamed.first_step_s,
                      synchronous_s=before_s + read + plain.first_step_s,
                      disk_bytes_per_s=plan.hardware.disk_read_bytes_per_s)
