"""The compute-dtype cast: where the bf16 weights each load streams to the GPU come from (the `cast` pass).

Where it sits: a planner pass between `sync` and `verify` (passes.py); `Program.cast` carries the choice and
runtime/cast.py carries it out. Try it: `megatrain plan --model llama3-8b --hardware h200 --gpu-mem 80GiB
--seq-len 8192 --micro-batch 1 --explain`.

A bf16 run keeps fp32 masters (host_policy.py) and computes in bf16, so every `load_params` needs its unit
cast. Three places:
- host: the h2d worker casts each chunk of the master into the pinned staging ring (runtime/cast_kernel.c, on
  its threads: `Hardware.cast_threads`) while the link carries the chunk before: a load costs max(link 2 B,
  1 / host cast rate) per element;
- gpu: the pinned fp32 master crosses the link into a device fp32 staging buffer (`cast`, as many elements as
  one staging buffer of the host ring, a static program buffer) and the h2d stream casts it into the slot: link
  4 B + 1 / device cast rate per element, no host CPU, the buffer's device bytes;
- copy: a persistent bf16 copy of the weights in pinned host memory (2 B per parameter, in place of the
  staging ring) that the host optimizer writes in its own pass (cast_kernel.c mt_adamw_copy: 2 B more per
  parameter at the step's rate); a load is then a plain DMA of 2 B per element.
The pass prices the program the earlier passes built under each place with the estimator (the step's
critical path, estimate.py, with that place's load and optimizer costs), drops the places the budgets do not
allow (gpu: the program's device peak plus the staging buffer beyond the GPU budget, or a profile without a
device cast rate; copy: the host bytes with the copy beyond host memory) and takes the fastest; another place
than host only when it shortens the step by more than SAVING (host holds the least memory). The schedule
(placement, slots, optimizer order) was searched with the host cast's prices. fp32 compute casts nothing
("none"): its pinned masters cross the link themselves.
"""

from __future__ import annotations

from dataclasses import replace

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Program

from .bytesize import format_bytes
from .collectives import cost_model
from .costs import CostModel, default_cast
from .estimate import estimate_time
from .hardware import Hardware
from .host_policy import HostPolicy, aligned, staging_elems
from .report import program_host_breakdown
from .state import CastChoice
from .timeline import program_timeline
from .world import World

PLACES = ("host", "gpu", "copy")
SAVING = 0.01  # a place other than host must shorten the step by more than this fraction
BUFFER = "cast"  # the device fp32 staging buffer of the "gpu" place


def device_stage_elems(ir: ModelIR) -> int:
    """fp32 elements of the "gpu" place's device staging buffer: one host staging buffer's worth, so a load
    crosses in the same chunks."""
    return staging_elems(ir)


def with_cast(program: Program, ir: ModelIR, where: str) -> Program:
    """`program` casting at `where`: the field set and, for "gpu", the static `cast` buffer added."""
    bufs = tuple(b for b in program.buffers if b.kind != "cast_stage")
    if where == "gpu":
        bufs += (Buffer(name=BUFFER, kind="cast_stage", nbytes=4 * device_stage_elems(ir), static=True),)
    return program.replace(buffers=bufs, cast=where)


def check(program: Program, ir: ModelIR) -> list[str]:
    """What is wrong with `program`'s cast (verify.py): a place for the wrong dtype, or the `cast` buffer
    missing, misplaced or of the wrong size."""
    where = program.cast if program.cast is not None else default_cast(ir.dtype)
    stages = [b for b in program.buffers if b.kind == "cast_stage"]
    if ir.dtype == "float32" and where != "none":
        return [f"an fp32 program casts nothing, but its cast is {where!r}"]
    if ir.dtype != "float32" and where == "none":
        return [f"a {ir.dtype} program's loads need a cast (host, gpu or copy), but its cast is 'none'"]
    want = [(BUFFER, True, 4 * device_stage_elems(ir))] if where == "gpu" else []
    got = [(b.name, b.static, b.nbytes) for b in stages]
    if got == want:
        return []
    need = f"one static `{BUFFER}` buffer of {want[0][2]} bytes" if want else "no cast_stage buffer"
    return [f"cast {where!r} needs {need}; the program has {got or 'none'} (name, static, bytes)"]


def rate(hw: Hardware, costs: CostModel, where: str) -> float | None:
    """Elements/s of the cast at `where`: the host's on the h2d worker's threads, the device's, or for "copy"
    the host optimizer's parameters/s (the cast rides in its pass)."""
    if where == "host":
        return hw.host_cast_rate()
    if where == "gpu":
        return hw.device_cast_elements_per_s
    if where == "copy":
        return costs.opt_rate / (costs.policy.traffic * costs.copy_factor)
    return None


def copy_extra_bytes(ir: ModelIR) -> int:
    """Host bytes the "copy" place holds beyond the "host" place's: the pinned bf16 copy of every unit's
    masters less the staging ring it replaces (each buffer at its pinned alignment)."""
    copy = sum(aligned(2 * u.host_numel) for u in ir.units)
    return copy - 2 * aligned(2 * staging_elems(ir))


def reserves(ir: ModelIR, where: str, world: World, rank_irs: tuple[ModelIR, ...]) -> tuple[int, int]:
    """(device bytes, node host bytes) the place `where` holds beyond the host place's: the "gpu" staging
    buffer, the "copy" place's bf16 copies less the staging ring (every rank of a node)."""
    if where == "gpu":
        return 4 * device_stage_elems(ir), 0
    if where == "copy":
        return 0, max(copy_extra_bytes(r) for r in rank_irs or (ir,)) * world.ranks_per_node
    return 0, 0


def guess(ir: ModelIR, hw: Hardware, policy: HostPolicy, clip: bool, world: World, rank_irs: tuple[ModelIR, ...],
          n_micro: int, room: tuple[int, int]) -> tuple[str, list[str]]:
    """The place the schedule search prices loads with, before there is a program to estimate: the one whose
    busiest resource per step is least (compute: every forward and backward; h2d: two loads of every unit;
    host: every optimizer step), within `room` (device bytes beside the least-memory schedule, node host bytes
    beside the state); host unless another is under it by more than SAVING."""
    if ir.dtype == "float32":
        return "none", []
    bound, lines = {}, []
    for where in PLACES:
        device, host = reserves(ir, where, world, rank_irs)
        if (where == "gpu" and hw.device_cast_elements_per_s is None) or device > room[0] or host > room[1]:
            continue
        c = cost_model(ir, hw, policy, clip, world, where)
        busy = {"compute": n_micro * sum(c.fwd) + n_micro * sum(c.bwd), "h2d": 2 * sum(c.load), "host": sum(c.opt)}
        bound[where] = max(busy.values())
        lines.append(f"{where:<5} busiest resource {max(busy, key=lambda k: busy[k])} {bound[where]:.4g} s a step")
    best = min(bound, key=lambda w: bound[w])
    where = best if bound[best] < bound["host"] * (1 - SAVING) else "host"
    return where, [f"the schedule is searched with {where}'s prices (the least busiest-resource bound):", *lines]


def choose(ir: ModelIR, hw: Hardware, policy: HostPolicy, clip: bool, world: World, program: Program,
           budget: int, rank_irs: tuple[ModelIR, ...], only: str | None = None) -> CastChoice:
    """The place of the compute-dtype cast for `program` (its program, costs, estimate and decision lines);
    `only`: price that place alone (the program was searched again with its prices)."""
    if ir.dtype == "float32":
        prog, costs = with_cast(program, ir, "none"), cost_model(ir, hw, policy, clip, world, "none")
        return CastChoice("none", prog, costs, estimate_time(prog, costs), None,
                      "fp32 compute: the pinned fp32 masters cross the link themselves; nothing is cast", {},
                      ("none: fp32 compute, the pinned fp32 masters cross the link themselves",))
    peak = program_timeline(program).peak
    rows: dict[str, tuple] = {}
    lines: list[str] = []
    for where in (only, "host") if only else PLACES:
        if only and rows:  # `only` fitted: nothing else to price (host stands in where it does not)
            break
        prog = with_cast(program, ir, where)
        why = _refusal(ir, hw, where, prog, peak, budget, policy, world, rank_irs)
        if why:
            lines.append(f"{where:<5} does not fit: {why}")
            continue
        costs = cost_model(ir, hw, policy, clip, world, where)
        rows[where] = (prog, costs, estimate_time(prog, costs))
    step = {w: r[2].step_time_s for w, r in rows.items()}
    best = min(step, key=lambda w: step[w])
    where = best if best == only or step[best] < step["host"] * (1 - SAVING) else "host"
    prog, costs, est = rows[where]
    for w in rows:
        lines.append(_line(ir, hw, w, rows[w][1], step[w], rows[w][2].bottleneck, policy, world, rank_irs, rows[w][0]))
    reason = _reason(hw, where, step)
    return CastChoice(where, prog, costs, est, rate(hw, costs, where), reason, step, (f"{where}: {reason}", *lines))


def searched_again(first: CastChoice, again: CastChoice, hw: Hardware, searched: str) -> CastChoice:
    """`again` (the place `first` chose, priced alone on the schedule searched again with its prices) with
    `first`'s alternatives: every place's step, the reason against them, and the lines of both."""
    step = {**first.step_s, again.where: again.estimate.step_time_s}
    reason = _reason(hw, again.where, step)
    note = (f"searched again with {again.where}'s prices: step {step[again.where]:.4g} s, against "
            f"{first.step_s[again.where]:.4g} s on the schedule searched with {searched}'s")
    return replace(again, reason=reason, step_s=step, lines=(f"{again.where}: {reason}", *first.lines[1:], note))


def _refusal(ir, hw, where, prog, peak, budget, policy, world, rank_irs) -> str:
    """Why `where` cannot be used ('' if it can)."""
    if where == "gpu":
        if hw.device_cast_elements_per_s is None:
            return f"hardware {hw.name!r} states no device cast rate (device_cast_elements_per_s)"
        stage = 4 * device_stage_elems(ir)
        if hw.gpu_bytes(peak + stage) > budget:
            return (f"its {format_bytes(stage)} device staging buffer takes the GPU to "
                    f"{format_bytes(hw.gpu_bytes(peak + stage))} of the {format_bytes(budget)} budget")
    if where == "copy":
        need = node_host_bytes(prog, policy, world, rank_irs or (ir,))
        if need > hw.host_memory_bytes:
            return f"host bytes with the bf16 copy {format_bytes(need)} of {format_bytes(hw.host_memory_bytes)}"
    return ""


def node_host_bytes(program: Program, policy: HostPolicy, world: World, irs: tuple[ModelIR, ...]) -> int:
    """Host bytes of the node holding the most: its ranks' shares (report.py counts the plan's the same way)."""
    totals = [sum(program_host_breakdown(r, program, policy).values()) for r in irs]
    L = world.ranks_per_node if len(irs) > 1 else 1
    return max(sum(totals[n * L:(n + 1) * L]) for n in range(len(totals) // L))


def _line(ir, hw, where, costs, step, bottleneck, policy, world, rank_irs, prog) -> str:
    r = rate(hw, costs, where)
    load = sum(costs.load)
    what = {"host": f"host cast {r / 1e9:.3g} G elements/s on {hw.cast_threads} thread(s), link 2 B",
            "gpu": f"link 4 B, device cast {r / 1e9:.4g} G elements/s, + {format_bytes(4 * device_stage_elems(ir))} "
                   "on the device",
            "copy": f"link 2 B, the optimizer writes the bf16 copy (+2 B/param: optimizer x{costs.copy_factor:.3g}), "
                    f"host {format_bytes(node_host_bytes(prog, policy, world, rank_irs or (ir,)))}"}[where]
    return f"{where:<5} step {step:.4g} s (bottleneck {bottleneck}), every unit's load once {load:.4g} s: {what}"


def _reason(hw: Hardware, where: str, step: dict[str, float]) -> str:
    others = ", ".join(f"{w} {s:.4g} s" for w, s in step.items() if w != where)
    vs = f" vs {others}" if others else ""
    if where == "host":
        lead = (f"cast on the host at {hw.host_cast_rate() / 1e9:.3g} G elements/s ({hw.cast_threads} thread(s)) into "
                f"pinned staging")
        if step and min(step.values()) < step["host"]:
            lead += f"; no other place saves over {SAVING:.0%}"
    elif where == "gpu":
        lead = (f"fp32 crosses the link and the GPU casts it ({hw.device_cast_elements_per_s / 1e9:.4g} G "
                "elements/s)")
    else:
        lead = "a bf16 copy in pinned host memory, written by the optimizer step; loads are plain DMA"
    return f"{lead}: step {step[where]:.4g} s{vs}"
