"""Checkpoints written while training goes on: the checkpointing step program, its rules and its price.

Where it sits: beside the step program, as planner/evaluation.py's evaluation program is. The Trainer runs
the program `checkpoint_program(step)` returns instead of the step program at the step after a checkpoint is
due (runtime/checkpoint_stream.py runs its ops); `megatrain plan --checkpoint-every N` prints
`checkpoint_cost`. Try it: `pytest tests/planner/test_checkpoint_writes.py -q`.

A checkpointing step saves the state it starts from, unit by unit, on the `disk` stream (a host thread of its
own), with no second copy of the model: each unit's file is written after the previous step's update of the
unit and before this step's, so the checkpoint is exactly the synchronous one of the previous step.
- disk: per stepped unit, in the order the optimizer steps them, a wait for the previous step's first host
  record after the unit's optimizer_step (a cross-step wait on an event the step program records too; where it
  records none after the update, `ckpt.begin`, which this step's host stream records first, once the previous
  step's host optimizer has finished), then `save_state(u)` and `record(ckpt.saved.u)`; then
  `seal_checkpoint()` (the manifest with every file's sha256, the atomic rename);
- host: `wait(ckpt.saved.u)` before this step's `optimizer_step(u)`; nothing else changes.
A unit whose state lives on the device (issue 40's `device_step`, on the compute stream) is written the same
way on the compute stream's order (the previous step's first compute record after its device_step, or
`ckpt.device`, which this step's compute stream records first); its save (written first: the compute stream waits for
it) copies the device state into the host store's mirror, then writes the mirror; `wait(ckpt.saved.u)` comes
before this step's `device_step(u)`.
So the writes overlap the step's forward and backward; a step whose writes outlast the time until each unit's
update holds the optimizer back, which the plan prices (`checkpoint_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Instr, Program

from .costs import unit_file_bytes
from .host_policy import HostPolicy

BEGIN = "ckpt.begin"  # first on the host: the previous step's optimizer_steps have run
DEVICE = "ckpt.device"  # first on the compute stream: the previous step's device_steps have run
SAVED = "ckpt.saved."
STEPS = {"optimizer_step": ("host", BEGIN), "device_step": ("compute", DEVICE)}  # an update's stream, its mark


class CheckpointPlanError(ValueError):
    """A step program whose checkpoints cannot be written while it trains."""


def saved_event(unit: str) -> str:
    return SAVED + unit


def checkpoint_program(step: Program) -> Program:
    """The checkpointing step beside step program `step`: the same instructions, plus the writes of the state the
    step starts from on the disk stream and the host waits that keep each unit's update behind its write."""
    if step.purpose != "step":
        raise CheckpointPlanError(f"a checkpointing step is planned beside a step program, not a {step.purpose} one")
    if any(ins.stream == "disk" for ins in step.instrs):
        raise CheckpointPlanError("the program already writes a checkpoint (it has disk instructions)")
    marks, disk = [], []
    for op in ("device_step", "optimizer_step"):  # device units first: the compute stream waits for theirs
        stream, mark = STEPS[op]
        records = [(i, ins.event) for i, ins in enumerate(step.instrs) if ins.op == "record" and ins.stream == stream]
        waited = None
        for i, unit in [(i, ins.unit) for i, ins in enumerate(step.instrs) if ins.op == op]:
            # the previous step's first record on the update's stream after the update (a cross-step wait: it comes
            # later in the program); where the step program records none, the mark this step's stream records
            # first, once every update of the previous step has run
            event = next((e for j, e in records if j > i), mark)
            if event == mark and all(m.event != mark for m in marks):
                marks.append(Instr(op="record", stream=stream, event=mark))
            if event != waited:
                disk.append(Instr(op="wait", stream="disk", event=event))
                waited = event
            disk += [Instr(op="save_state", stream="disk", unit=unit),
                     Instr(op="record", stream="disk", event=saved_event(unit))]
    disk.append(Instr(op="seal_checkpoint", stream="disk"))
    body: list[Instr] = []
    for ins in step.instrs:
        if ins.op in STEPS:
            body.append(Instr(op="wait", stream=ins.stream, event=saved_event(ins.unit)))
        body.append(ins)
    return step.replace(instrs=(*marks, *disk, *body))


def check_pair(step: Program, ck: Program) -> list[str]:
    """Problems with `ck` as the checkpointing step of `step` (one line each; empty: none): it must be `step`
    plus the disk stream and its events, so a step of either program may follow one of the other."""
    ours = {BEGIN, DEVICE} | {saved_event(ins.unit) for ins in ck.instrs if ins.op == "save_state"}
    rest = tuple(ins for ins in ck.instrs if ins.stream != "disk" and ins.event not in ours)
    return step_besides(step, ck, rest, "the checkpointing step", "writes", "each must be able to follow the other")


def step_besides(step: Program, other: Program, rest: tuple, name: str, ops: str, why: str) -> list[str]:
    """Problems with `other` as `step` plus a disk stream's `ops` (`rest`: its instructions without them and
    their events): the same instructions in the same order, and the same buffers."""
    problems = []
    if rest != step.instrs:
        at = next((k for k, (a, b) in enumerate(zip(rest, step.instrs)) if a != b), min(len(rest), len(step.instrs)))
        problems.append(f"{name} differs from the step program at its instruction {at} besides its {ops}; {why}")
    if {b.name for b in other.buffers} != {b.name for b in step.buffers}:
        problems.append(f"{name} has other buffers than the step program")
    return problems


def check_writes(program: Program, hb, at) -> list[str]:
    """The verifier's rules for a program that writes a checkpoint (verify.py; `hb` its happens-before, `at` its
    instruction label): one save_state per stepped unit, after the previous step's update of the unit
    (optimizer_step or device_step) and before this step's, and one seal_checkpoint, the disk stream's last
    instruction."""
    instrs = program.instrs
    saves = [(i, ins) for i, ins in enumerate(instrs) if ins.op == "save_state"]
    updates = {ins.unit: i for i, ins in enumerate(instrs) if ins.op in STEPS}
    seals = [i for i, ins in enumerate(instrs) if ins.op == "seal_checkpoint"]
    if not saves and not seals:
        return []
    problems = []
    opt = updates
    seen: dict[str, int] = {}
    for i, ins in saves:
        if ins.unit in seen:
            problems.append(f"{at(i, ins)} writes {ins.unit} a second time (first at instruction {seen[ins.unit]})")
            continue
        seen[ins.unit] = i
        o = opt.get(ins.unit)
        if o is None:
            problems.append(f"{at(i, ins)} writes {ins.unit}, which no optimizer_step or device_step updates")
            continue
        if not hb.before((0, o), (1, i)):
            problems.append(f"{at(i, ins)} may write {ins.unit} before the previous step's {instrs[o].op} has "
                            "updated it (missing wait)")
        if not hb.before((1, i), (1, o)):
            problems.append(f"{at(o, instrs[o])} may update {ins.unit} before {at(i, ins)} has written it "
                            "(missing wait)")
    problems += [f"{instrs[o].op}({u}) has no save_state: the checkpoint would miss {u}" for u, o in opt.items()
                 if u not in seen]
    disk = [i for i, ins in enumerate(instrs) if ins.stream == "disk" and ins.op not in ("record", "wait")]
    if len(seals) != 1 or disk[-1] != seals[0]:
        problems.append(f"a checkpointing step has one seal_checkpoint, after every save_state on the disk stream "
                        f"(found {len(seals)})")
    return problems


# -- the price -----------------------------------------------------------------------------------------------------
def checkpoint_bytes(ir: ModelIR, policy: HostPolicy | str) -> int:
    return sum(unit_file_bytes(u, policy) for u in ir.units)


@dataclass(frozen=True)
class CheckpointCost:
    bytes: int  # of the unit files, this rank's
    write_s: float  # the disk stream's busy time: every save_state and the seal
    step_s: float  # the predicted step of the plain program
    checkpoint_step_s: float  # the predicted step of the checkpointing program, every step one
    disk_bytes_per_s: float
    every: int | None = None
    ranks: int = 1  # in a world: `bytes` are rank 0's files, the most any rank writes,
    node_ranks: int = 1  # through the disk its node's ranks share

    @property
    def extra_s(self) -> float:
        """What one checkpoint adds to the run: the checkpointing step's time over the plain step's."""
        return max(0.0, self.checkpoint_step_s - self.step_s)

    def per_step_s(self, every: int) -> float:
        return self.extra_s / every

    def lines(self, every: int | None = None) -> list[str]:
        from .bytesize import format_bytes

        whose = f" on rank 0 of {self.ranks} (its shards and the replicated units)" if self.ranks > 1 else ""
        shared = f", shared by a node's {self.node_ranks} ranks" if self.node_ranks > 1 else ""
        out = [f"checkpoint: {format_bytes(self.bytes)}{whose} written at {self.disk_bytes_per_s / 1e9:.3g} GB/s (the "
               f"hardware's disk_write_bytes_per_s{shared}) in {self.write_s:.3g} s while training goes on; the checkpointing "
               f"step takes {self.checkpoint_step_s:.4g} s against {self.step_s:.4g} s, +{self.extra_s:.4g} s per "
               "checkpoint"]
        if every:
            out.append(f"--checkpoint-every {every}: +{self.per_step_s(every):.4g} s per step amortised "
                       f"({self.per_step_s(every) / self.step_s:.1%} of the step)")
            check = self.check(every)
            if check:
                out.append(check)
        return out

    def check(self, every: int) -> str | None:
        """One line when checkpoints every `every` steps cost more than their steps: the writes outlast them."""
        if self.write_s <= every * self.step_s:
            return None
        least = int(self.write_s // self.step_s) + 1
        return (f"warning: a checkpoint's writes take {self.write_s:.3g} s, longer than {every} step(s) "
                f"({every * self.step_s:.3g} s): the run would spend most of its time writing; pass "
                f"--checkpoint-every {least} or more, or checkpoint to a faster disk (--hardware FILE from "
                "`megatrain probe` states its speed)")


def checkpoint_cost(plan) -> CheckpointCost:
    """The price of a checkpoint under `plan`: its bytes, the disk's time for them, and the checkpointing step's
    predicted time beside the plain step's, both estimated with the same cost model (estimate.py)."""
    from .collectives import cost_model
    from .estimate import estimate_time

    step = plan.program
    clip = any(ins.op == "clip_grads" for ins in step.instrs)
    world = plan.world if plan.world.nproc > 1 else None
    costs = cost_model(plan.ir, plan.hardware, plan.host_policy, clip, world, plan.cast)
    ck = checkpoint_program(step)
    plain, with_writes = estimate_time(step, costs), estimate_time(ck, costs)
    write = sum(d for d, ins in zip(with_writes.duration_s, ck.instrs)
                if ins.op in ("save_state", "seal_checkpoint"))
    nbytes = sum(costs.save_bytes[costs.index[ins.unit]] for ins in ck.instrs if ins.op == "save_state")
    return CheckpointCost(bytes=nbytes, write_s=write, step_s=plain.step_time_s,
                          checkpoint_step_s=with_writes.step_time_s, disk_bytes_per_s=plan.hardware.disk_write_bytes_per_s,
                          ranks=plan.world.nproc, node_ranks=plan.world.ranks_per_node)
