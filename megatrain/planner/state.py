"""What the planner's passes hand on (passes.py): the pipeline State, and the cast pass's choice.

Where it sits: below the passes and the modules they call, so that report.py and cast.py read what a pass
decided without importing the pipeline that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Program

from .costs import CostModel
from .estimate import Estimate
from .hardware import Hardware
from .host_policy import HostPolicy
from .schedule import Decisions, Op, Order
from .timeline import Timeline
from .train import TrainSpec
from .world import World


@dataclass(frozen=True)
class CastChoice:
    where: str
    program: Program
    costs: CostModel
    estimate: Estimate
    elements_per_s: float | None  # the rate the chosen place's cast is priced at
    reason: str
    step_s: dict[str, float]  # every place that fits: its predicted step
    lines: tuple[str, ...]


@dataclass(frozen=True)
class State:
    ir: ModelIR
    hw: Hardware
    train: TrainSpec
    budget: int
    costs: CostModel
    host_request: str = "auto"
    barrier: bool = False  # the host optimizer waits for every gradient (clip_grads): a clip, or a whole step
    world: World = World()  # the ranks this rank trains with; `train` is one rank's share of the global step
    global_train: TrainSpec | None = None  # the whole step (every rank's micro-batches); None: `train`
    rank_irs: tuple[ModelIR, ...] = ()  # each rank's host view of `ir` (world.rank_ir); () for one rank
    policy: HostPolicy | None = None
    host_floor: int = 0  # host bytes of the policy's state, fewest gradient buffers and staging (of a node)
    host_reason: str = ""
    decisions: Decisions | None = None
    order: Order | None = None
    ops: tuple[Op, ...] | None = None
    buffers: tuple[Buffer, ...] | None = None
    program: Program | None = None
    timeline: Timeline | None = None
    estimate: Estimate | None = None
    cast: CastChoice | None = None
    # the place of the compute-dtype cast the schedule is searched with (cast_prices_pass, or _replan's), and
    # what that place holds beyond the host place's: the search leaves these bytes free
    searched_cast: str | None = None
    device_reserve: int = 0  # device bytes of the "gpu" place's staging buffer
    host_reserve: int = 0  # node host bytes of the "copy" place beyond the staging ring
    first_cast: CastChoice | None = None  # the cast pass's choice on the first search, when searched again
    first_searched: str | None = None  # the place the first search was priced with
    # per-unit state placement (issue 40, residency.py): what plan(resident=...) asked for ("none", "auto" or a
    # mapping unit -> place), and the places the residency pass settled on (Decisions.state; (): all host)
    resident_request: object = "none"
    state_place: tuple[str, ...] = ()
    # the residency pass's own run of the schedule passes (checkpoints .. sync) on the places it chose, and their
    # PassRecords: plan() goes on from there rather than running them again; None: run them
    scheduled: tuple | None = None
