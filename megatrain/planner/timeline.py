"""The device memory timeline of a Program, computed exactly from the schedule IR's memory rule.

Where it sits: the estimator reports it, the verifier checks its peak against the budget, the placement
search measures candidates with it. Try it:
`python -c "from megatrain.planner import memory_timeline; help(memory_timeline)"`.

The rule (ir/README.md): device memory is allocated and freed only on the compute stream; a dynamic buffer
is allocated by `alloc` or by its first compute-stream writer and ends at `free`; static buffers live all
step. So walking the compute stream in program order gives exactly what the device holds, whatever the copy
streams do. One entry per compute-stream instruction: the bytes live while it runs (after its allocations,
and for `free` after the release), plus its workspace in `memory_timeline`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatrain.ir.program import Program


@dataclass(frozen=True)
class Timeline:
    """Per compute-stream instruction: program index, bytes of live buffers, and workspace."""

    index: tuple[int, ...]
    buffers: tuple[int, ...]
    workspace: tuple[int, ...]

    @property
    def total(self) -> list[int]:
        return [b + w for b, w in zip(self.buffers, self.workspace)]

    @property
    def peak(self) -> int:
        return max(self.total, default=0)

    @property
    def peak_buffers(self) -> int:
        return max(self.buffers, default=0)

    @property
    def peak_at(self) -> int:
        """Position (in this timeline) of the first instruction at the peak."""
        total = self.total
        return total.index(max(total)) if total else 0


def walk(instrs: Sequence, sizes: dict[str, int], static: Iterable[str]) -> Timeline:
    """The timeline of `instrs` (Instr or planner Op) given buffer sizes and the static buffer names."""
    static = set(static)
    live: set[str] = set()
    current = sum(sizes[name] for name in static)
    index, buffers, workspace = [], [], []
    for i, ins in enumerate(instrs):
        if ins.stream != "compute":
            continue
        op = ins.op
        if op == "alloc":
            if ins.buffer not in live:
                live.add(ins.buffer)
                current += sizes[ins.buffer]
        elif op == "free":
            if ins.buffer in live:
                live.discard(ins.buffer)
                current -= sizes[ins.buffer]
        elif op in ("forward", "backward"):
            for name in ins.writes:
                if name not in static and name not in live:
                    live.add(name)
                    current += sizes[name]
        index.append(i)
        buffers.append(current)
        workspace.append(ins.workspace_bytes if op in ("forward", "backward", "device_step") else 0)
    return Timeline(tuple(index), tuple(buffers), tuple(workspace))


def program_timeline(program: Program) -> Timeline:
    sizes = {b.name: b.nbytes for b in program.buffers}
    return walk(program.instrs, sizes, (b.name for b in program.buffers if b.static))


def live_bytes(program: Program) -> list[int]:
    """Device bytes of live Program buffers after each instruction, every stream's (what the step program's
    comments show, codegen/emit.py): a copy stream's instruction changes nothing, so it repeats the last."""
    tl = program_timeline(program)
    at = dict(zip(tl.index, tl.buffers))
    live, out = sum(b.nbytes for b in program.buffers if b.static), []
    for i in range(len(program.instrs)):
        live = at.get(i, live)
        out.append(live)
    return out


def memory_timeline(program: Program) -> list[int]:
    """Device bytes (live buffers + the running instruction's workspace) per compute-stream instruction."""
    return program_timeline(program).total


def buffer_timeline(program: Program) -> list[int]:
    """Device bytes of live Program buffers alone (no workspace) per compute-stream instruction."""
    return list(program_timeline(program).buffers)


def peak_buffer_bytes(program: Program) -> int:
    """Peak of Program buffers, static plus dynamic, no workspace: what a sim device's pool measures."""
    return program_timeline(program).peak_buffers


def live_at(instrs: Sequence, static: Iterable[str], position: int) -> list[str]:
    """Names of the buffers live while instruction `position` (a program index) runs."""
    live = list(static)
    dynamic: set[str] = set()
    for ins in instrs[: position + 1]:
        if ins.stream != "compute":
            continue
        if ins.op == "alloc":
            dynamic.add(ins.buffer)
        elif ins.op == "free":
            dynamic.discard(ins.buffer)
        elif ins.op in ("forward", "backward"):
            dynamic.update(w for w in ins.writes if w not in live)
    return live + sorted(dynamic)
