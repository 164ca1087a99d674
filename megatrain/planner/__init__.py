"""megatrain.planner: hardware profiles, the planning passes, the memory timeline, the verifier and tuning.

Where it sits: ModelIR + Hardware + TrainSpec + GPU budget -> `plan()` -> Plan (decisions, Program,
predictions), which codegen renders and the runtime executes (docs/DESIGN.md 4.3). Try it:
`megatrain plan --model llama3-70b --hardware h100-sxm --gpu-mem 80GiB --seq-len 8192 --micro-batch 1`.
"""

from .bytesize import format_bytes, parse_bytes
from .errors import InfeasiblePlanError, ScheduleError
from .hardware import PRESETS as HARDWARE_PRESETS
from .hardware import Hardware, hardware_preset, load_hardware, resolve_hardware
from .passes import PASSES, plan
from .plan import PassRecord, Plan, UnitPlan
from .timeline import buffer_timeline, memory_timeline, peak_buffer_bytes
from .train import TrainSpec
from .tune import TuneResult, TuneRow, tune
from .verify import check, verify

__all__ = [
    "HARDWARE_PRESETS", "PASSES", "Hardware", "InfeasiblePlanError", "PassRecord", "Plan", "ScheduleError",
    "TrainSpec", "TuneResult", "TuneRow", "UnitPlan", "buffer_timeline", "check", "format_bytes",
    "hardware_preset", "load_hardware", "memory_timeline", "parse_bytes", "peak_buffer_bytes", "plan",
    "resolve_hardware", "tune", "verify",
]
