"""Errors a planner user can cause. Both are ValueErrors with one-line messages naming the cause and the fix.

Where it sits: `plan()` raises InfeasiblePlanError before anything is allocated; `verify()` raises
ScheduleError for a Program that breaks the schedule IR's rules (ir/README.md). The top-level CLI prints
`error: <message>` and exits 2.
"""

from __future__ import annotations


class InfeasiblePlanError(ValueError):
    """No schedule fits. `kind` is "gpu" or "host"; `needed_bytes` is the smallest budget that works
    (GPU: found by search over the minimal-memory configurations; host: what the model state needs)."""

    def __init__(self, message: str, *, kind: str, needed_bytes: int, budget_bytes: int, dominant: str):
        super().__init__(message)
        self.kind = kind
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.dominant = dominant


class ScheduleError(ValueError):
    """A Program violates the schedule rules; `problems` lists every violation found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"invalid schedule: {problems[0]}{more}")
