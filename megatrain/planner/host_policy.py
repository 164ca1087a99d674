"""Host state policies: how the host holds the model's state, what that costs in bytes and in quality, and the
planner's choice of one (`megatrain plan --host-policy auto|NAME`).

Where it sits: the `host_policy` pass (passes.py, the first) calls `choose`; report.py prices the final
program's host memory with `host_layout`; costs.py prices the host optimizer with `HostPolicy.traffic`; the
runtime (runtime/host_state.py) implements each policy's optimizer step and runtime/store.py allocates what
`host_layout` counts (tests/runtime/test_host_policy.py checks the two agree on the sim device).
Try it: `megatrain plan --model dense-120b --hardware h200 --seq-len 4096 --micro-batch 1 --host-mem 1.5TB`.

Every policy keeps fp32 master weights. What it compresses is what waits between steps or units:
| policy | AdamW moments | gradients held on host | B/param, no clip / clip |
|---|---|---|---|
| exact | fp32 | fp32 | 12 / 16 |
| bf16-moments | bf16 (stochastic rounding) | fp32 | 8 / 12 |
| bf16 | bf16 | bf16 (the clip norm is computed in fp32 on the device) | 8 / 10 |
| fp8 | float8 e4m3 per 256-element block with an fp32 scale (v floored at the block's least step) | bf16 | 6.03 / 8.03 |

No policy keeps a persistent compute-dtype copy of its own: by default a bf16 unit's H2D source is cast from
the master into a pinned staging ring as it is loaded (2 x 16M elements); the `cast` pass (cast.py) may instead
pin the masters and cast on the GPU, or keep a pinned bf16 copy the optimizer writes (`transfer_buffers`); an
fp32 unit's master is itself pinned and crosses the link. A gradient lives on host only while something waits for it: the units stepped as their gradients land
take turns in a ring of host gradient buffers (two at least; the optimizer pass takes more when host memory
allows and they shorten the step); with clipping (every gradient waits for the global norm) or after the
optimizer split (those wait for the backward to end) a unit has a buffer of its own (schedule.py
`host_grad_assignment`). So the B/param above is the state and the floor counts the fewest gradient buffers;
waiting gradients, the staging ring, per-parameter gradient norms and offloaded checkpoints come on top, at
their exact sizes.

Pinned memory (whatever crosses the link: gradient buffers, the staging ring, fp32 masters, unit buffers,
norms, checkpoints) is one region allocated once, each buffer at a PIN_ALIGN boundary, the region a whole
number of pages plus one page of slack to align its start; pageable state (bf16 runs' masters, moments, step
counts) is one exact-size allocation per buffer. `host_layout` counts both exactly as runtime/host_memory.py
allocates them: no power-of-two rounding anywhere.

Quality (`quality_cost`): the upper end of the 95% interval of the policy's validation-loss cost relative to exact,
the larger of its ends at AdamW beta2 0.95 and 0.999, measured by benchmarks/quality_host_policy.py as shadow
runs (the compressed update stepped beside the exact one on exact's gradients, so run-to-run chaos drops out;
docs/RESULTS.md, "Host memory policies: quality"). `auto` takes the first policy of ORDER (most exact first)
whose floor (state + the fewest gradient buffers + staging) fits host memory and whose quality_cost is at most
QUALITY_TOLERANCE: a policy whose interval reaches past the tolerance at either beta2 is not auto's, however its
mean reads; a policy not measured is never chosen by auto.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from megatrain.ir.base import dtype_bytes
from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import STAGING_BYTES

from .bytesize import format_bytes
from .errors import InfeasiblePlanError
from .transfers import STAGING_BUFFERS, staging_bytes

PIN_ALIGN = 64  # bytes: every pinned buffer starts on a cache line
PAGE = 4096
STAGE_ELEMS = 1 << 24  # elements per staging buffer (32 MiB in bf16); two of them make the ring
FP8_BLOCK = 256  # elements per fp8 quantisation block; blocks start at each parameter's first element
QUALITY_TOLERANCE = 0.005  # auto never takes a policy costing more validation loss than this fraction


@dataclass(frozen=True)
class HostPolicy:
    name: str
    moments: str  # "float32" | "bfloat16" | "fp8"
    grads: str  # dtype of host gradient buffers: "float32" | "bfloat16"
    quality_cost: float | None  # measured, see the module docstring; None: not measured
    summary: str

    @property
    def grad_bytes(self) -> int:
        return dtype_bytes(self.grads)

    @property
    def moment_bytes(self) -> float:
        """Bytes per element of both moments, quantisation scales included (fp8: per full block)."""
        return 8.0 if self.moments == "float32" else 4.0 if self.moments == "bfloat16" else 2 + 8 / FP8_BLOCK

    def bytes_per_param(self, clip: bool) -> float:
        """The nominal state per parameter: master, moments, and (with clipping) the gradient held for it."""
        return 4 + self.moment_bytes + (self.grad_bytes if clip else 0)

    @property
    def traffic(self) -> float:
        """Host memory bytes one optimizer step moves per parameter: master read + write (8), the gradient
        read, each moment read + written in its dtype (fp8: and its block scales). The clip factor and the
        NaN/inf verdict add nothing (runtime/host_state.py)."""
        return 8 + self.grad_bytes + 2 * self.moment_bytes

    def moment_state_bytes(self, numels: Iterable[int], flat: int) -> int:
        """Both moments of a unit with `flat` elements whose owned parameters have `numels` elements."""
        if self.moments != "fp8":
            return int(self.moment_bytes) * flat
        return 2 * flat + 2 * 4 * sum(math.ceil(n / FP8_BLOCK) for n in numels)


POLICIES: dict[str, HostPolicy] = {p.name: p for p in (
    HostPolicy("exact", "float32", "float32", 0.0,
               "fp32 moments and gradients: bit-identical to eager fused AdamW"),
    # quality costs: the larger upper 95% end over both beta2 of benchmarks/quality_host_policy.py's shadow runs
    # (fp8: docs/log/2026-12-06-host-policy-shadow.md; bf16: docs/log/2026-12-06-stochastic-rounding.md, with
    # stochastically rounded moments, whose second moments follow v's small steps at beta2 0.999 where
    # round-to-nearest ones stalled)
    HostPolicy("bf16-moments", "bfloat16", "float32", 0.00030,
               "bf16 moments, fp32 gradients"),
    HostPolicy("bf16", "bfloat16", "bfloat16", 0.00038,
               "bf16 moments and held gradients (fp32 clip norm on the device)"),
    HostPolicy("fp8", "fp8", "bfloat16", 0.375,
               "fp8 e4m3 block-scaled moments, bf16 held gradients"),
)}
ORDER = tuple(POLICIES)  # most exact first


def canonical(name: str) -> str:
    """A policy name as written by hand (`FP8`, `bf16_moments`, ` exact`) in the form POLICIES keys it."""
    return name.strip().lower().replace("_", "-")


def read_request(name: str) -> str:
    """--host-policy / host_policy= as given: "auto", or the name of the policy it resolves to (ValueError if none)."""
    return "auto" if canonical(name) == "auto" else resolve(name).name


def resolve(name: str | HostPolicy) -> HostPolicy:
    if isinstance(name, HostPolicy):
        return name
    try:
        return POLICIES[canonical(name)]
    except KeyError:
        raise ValueError(f"unknown host policy {name!r}; use auto or one of {', '.join(ORDER)}") from None


# -- exact host bytes ------------------------------------------------------------------------------------------
def aligned(nbytes: int) -> int:
    return -(-nbytes // PIN_ALIGN) * PIN_ALIGN


def pinned_region_bytes(sizes: Iterable[int]) -> int:
    """Bytes of the one pinned region holding buffers of `sizes` (runtime/host_memory.py allocates it)."""
    total = sum(aligned(s) for s in sizes)
    return -(-total // PAGE) * PAGE + PAGE if total else 0


def staging_elems(ir: ModelIR) -> int:
    """Elements of one staging buffer (0: fp32 compute, whose pinned masters cross the link themselves)."""
    return 0 if ir.dtype == "float32" else min(STAGE_ELEMS, max(u.flat_numel for u in ir.units))


def grad_buffer_elems(ir: ModelIR, assignment: Sequence[int]) -> list[int]:
    """Elements of each host gradient buffer hgrad{k}: the largest unit assigned to it (None: a unit stepped on
    the device, which has none)."""
    used = [k for k in assignment if k is not None]
    sizes = [0] * (max(used) + 1 if used else 0)
    for u, k in zip(ir.units, assignment):
        if k is not None:
            sizes[k] = max(sizes[k], u.flat_numel)
    return sizes


def checkpoint_buffers(ir: ModelIR, placement: Sequence[str], n_micro: int,
                       replay: Sequence[bool] = ()) -> list[tuple[int, ...]]:
    """Bytes of every host checkpoint, tensor by tensor: each unit placed on host offloads its carry-in tensors
    once per micro-batch, and its attention record when it replays (one program buffer each, what the
    lowering offloads)."""
    out = []
    for i, (u, p) in enumerate(zip(ir.units, placement)):
        if p == "host" and u.carry_in:
            out += [tuple(t.nbytes for t in u.carry_in)] * n_micro
            if replay and replay[i]:
                out += [tuple(t.nbytes for t in u.replay)] * n_micro
    return out


def staged(checkpoint: Sequence[int]) -> bool:
    """Whether a host checkpoint crosses through the pinned staging buffers into pageable memory (one longer
    than a staging chunk: runtime/staging.py) rather than to its own pinned copy."""
    return sum(checkpoint) > STAGING_BYTES


def checkpoint_host_bytes(checkpoints: Sequence[Sequence[int]]) -> int:
    """Host bytes the checkpoints take: pinned copies at pinned alignment, pageable ones at their size, and
    the staging buffers when any is staged."""
    pinned = sum(-(-t // PIN_ALIGN) * PIN_ALIGN for c in checkpoints if not staged(c) for t in c)
    pageable = sum(t for c in checkpoints if staged(c) for t in c)
    return pinned + pageable + staging_bytes(max((sum(c) for c in checkpoints), default=0))


def transfer_buffers(ir: ModelIR, cast: str | None) -> tuple[bool, list[tuple[str, int]]]:
    """(masters pinned, [(component, bytes)] of the pinned buffers a load reads besides them) for the compute-dtype
    cast at `cast` (planner/cast.py; None: on the host for bf16): fp32 and "gpu" send the pinned masters
    themselves; "host" casts into the two-buffer staging ring; "copy" keeps a bf16 copy of every unit's masters."""
    db = dtype_bytes(ir.dtype)
    if ir.dtype == "float32" or cast in ("none", "gpu"):
        return True, []
    if cast == "copy":
        return False, [("transfer_copy", db * u.host_numel) for u in ir.units]
    return False, [("transfer_staging", db * staging_elems(ir))] * 2


def host_layout(ir: ModelIR, policy: HostPolicy, assignment: Sequence[int],
                checkpoints: Sequence[Sequence[int]] = (), cast: str | None = None) -> dict[str, int]:
    """Host bytes by component for `ir` under `policy`, with host gradient buffers as `assignment` gives
    (one entry per unit), offloaded `checkpoints` (tensor bytes of each: pinned, or pageable with the
    pinned checkpoint staging when longer than a staging chunk) and the compute-dtype cast at `cast`
    (transfer_buffers)."""
    pinned_master, transfer = transfer_buffers(ir, cast)
    pinned: dict[str, list[int]] = {"master_fp32": [], "grads": [], "grad_norms": [], "transfer_staging": [],
                                    "unit_buffers": [], "checkpoints": [t for c in checkpoints if not staged(c) for t in c],
                                    "checkpoint_staging": [], "transfer_copy": []}
    out = {"master_fp32": 0, "moments": 0, "step_counts": 0,
           "checkpoints": sum(t for c in checkpoints if staged(c) for t in c)}
    for u in ir.units:
        owned = [p.numel for p in u.params if p.name not in u.tied]
        if pinned_master:
            pinned["master_fp32"].append(4 * u.host_numel)
        else:
            out["master_fp32"] += 4 * u.host_numel
        out["moments"] += policy.moment_state_bytes(owned, u.host_numel)
        out["step_counts"] += 4 * len(owned)
        if u.buffers:
            pinned["unit_buffers"].append(u.buffer_bytes)
    pinned["grad_norms"].append(4 * sum(len(u.params) for u in ir.units))
    pinned["grads"] += [policy.grad_bytes * n for n in grad_buffer_elems(ir, assignment)]
    for key, nbytes in transfer:
        if nbytes:
            pinned[key].append(nbytes)
    if any(staged(c) for c in checkpoints):
        pinned["checkpoint_staging"] += [STAGING_BYTES] * STAGING_BUFFERS
    for key, sizes in pinned.items():
        out[key] = out.get(key, 0) + sum(sizes)
    every = [s for sizes in pinned.values() for s in sizes]
    out["pinned_alignment"] = pinned_region_bytes(every) - sum(every)
    return out


# -- the choice --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    policy: HostPolicy
    floor_bytes: int  # state + fewest gradient buffers + staging: what the host holds before checkpoints
    reason: str
    lines: tuple[str, ...]


def floor_bytes(ir: ModelIR, policy: HostPolicy, clip: bool) -> int:
    from .schedule import host_grad_assignment

    backward = tuple(range(len(ir.units) - 1, -1, -1))
    return sum(host_layout(ir, policy, host_grad_assignment(ir, backward, clip)).values())


def _eligible(p: HostPolicy) -> bool:
    return p.quality_cost is not None and p.quality_cost <= QUALITY_TOLERANCE


def _cost(p: HostPolicy) -> str:
    return "not measured" if p.quality_cost is None else f"quality cost {p.quality_cost:+.2%}"


def choose(ir: ModelIR, host_memory_bytes: int, clip: bool, request: str = "auto",
           floor: Callable[[HostPolicy], int] | None = None) -> Choice:
    """The host policy for `ir` with `host_memory_bytes`: `request` by name, or auto's choice. `floor(policy)`
    replaces floor_bytes (a rank of a world: its share of the state, planner/world.py)."""
    floors = {name: floor(p) if floor else floor_bytes(ir, p, clip) for name, p in POLICIES.items()}
    params = max(1, ir.params_total)
    lines = []
    for name, p in POLICIES.items():
        fits = "fits" if floors[name] <= host_memory_bytes else "does not fit"
        auto = "" if _eligible(p) else f", beyond auto's {QUALITY_TOLERANCE:.1%}" if p.quality_cost is not None \
            else ", never chosen by auto"
        lines.append(f"{name:<13} {p.bytes_per_param(clip):.3g} B/param ({floors[name] / params:.3g} with "
                     f"buffers): {format_bytes(floors[name])} {fits}; {_cost(p)}{auto}; {p.summary}")
    mem = format_bytes(host_memory_bytes)
    if canonical(request) != "auto":
        p = resolve(request)
        if floors[p.name] > host_memory_bytes:
            fit = [n for n in ORDER if floors[n] <= host_memory_bytes]
            alt = f" or --host-policy {fit[0]} ({format_bytes(floors[fit[0]])})" if fit else ""
            _refuse(ir, host_memory_bytes, floors[p.name], f"--host-policy {p.name} "
                    f"({p.bytes_per_param(clip):.3g} B/param)", alt)
        beyond = f", beyond auto's {QUALITY_TOLERANCE:.1%}" if p.quality_cost is not None and not _eligible(p) else ""
        reason = (f"{p.name} ({p.bytes_per_param(clip):.3g} B/param, {_cost(p)}{beyond}): asked for by --host-policy; "
                  f"needs {format_bytes(floors[p.name])} of {mem} before checkpoints")
        return Choice(p, floors[p.name], reason, (reason, *lines))
    candidates = [POLICIES[n] for n in ORDER if _eligible(POLICIES[n])]
    for p in candidates:
        if floors[p.name] <= host_memory_bytes:
            before = ORDER[: ORDER.index(p.name)]
            big = [n for n in before if floors[n] > host_memory_bytes]
            costly = [f"{n} {_cost(POLICIES[n])}" for n in before if n not in big]
            why = "".join([f"; {', '.join(big)} need{'s' if len(big) == 1 else ''} more host memory" if big else "",
                           f"; {', '.join(costly)} beyond {QUALITY_TOLERANCE:.1%}" if costly else ""])
            reason = (f"{p.name} ({p.bytes_per_param(clip):.3g} B/param, {_cost(p)}): the most exact policy within "
                      f"{QUALITY_TOLERANCE:.1%} quality cost that fits {mem}{why}")
            return Choice(p, floors[p.name], reason, (reason, *lines))
    last = candidates[-1]
    cheaper = [n for n in ORDER if floors[n] <= host_memory_bytes]
    alt = f" or --host-policy {cheaper[0]} ({_cost(POLICIES[cheaper[0]])})" if cheaper else ""
    _refuse(ir, host_memory_bytes, floors[last.name], f"the most compact policy auto may take, {last.name} "
            f"({last.bytes_per_param(clip):.3g} B/param),", alt)
    raise AssertionError("unreachable")


def _suggest(nbytes: int) -> str:
    """A flag value at least `nbytes`: rounded up to 0.01 TiB, 0.1 GiB or 1 MiB."""
    if nbytes >= 2**40:
        return f"{math.ceil(nbytes / 2**40 * 100) / 100:g}TiB"
    if nbytes >= 2**30:
        return f"{math.ceil(nbytes / 2**30 * 10) / 10:g}GiB"
    return f"{math.ceil(nbytes / 2**20)}MiB"


def _refuse(ir: ModelIR, host: int, need: int, what: str, alt: str) -> None:
    raise InfeasiblePlanError(
        f"host memory {format_bytes(host)} is too small for {ir.model}: {what} needs {format_bytes(need)} "
        f"({need / max(1, ir.params_total):.3g} B/param) for parameters, AdamW states and gradient buffers before "
        f"any checkpoint; use a machine with at least {_suggest(need)} of host memory (--host-mem if the "
        f"profile understates it){alt}", kind="host", needed_bytes=need, budget_bytes=host,
        dominant="model state")
