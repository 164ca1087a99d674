"""The numerical-fault verdict of the host store (`--on-nan`): whether an update may be applied, decided before
any weight changes.

Where it sits: the host store (store.py) asks it at a clip_grads barrier (`step_fault`: for the whole step) or,
without one, at each unit's optimizer step (`unit_fault`: for that unit). An update is applied only from finite
gradients: the verdict is the finiteness of the per-parameter gradient norms the device computed (a non-finite
norm is a non-finite or overflowing gradient), read as one flag, so no pass over the gradients checks them.
An update that could take a weight past fp32's range is refused too: the bound on |w| starts at the masters'
L2 norm (one pass, when unknown: `UnitState.bound`) and then grows by what each update can add
(host_state.update_bound), so steps read no weight.
"""

from __future__ import annotations

import math

import torch

from .host_state import update_bound

SAFE_MAX = float(torch.finfo(torch.float32).max) / 4  # a weight bound past this may overflow within the step


def _norm(v: torch.Tensor) -> float:
    """The L2 norm of a fp32 tensor (>= its largest |element|): the fast fp32 reduction, or in fp64 where
    squares overflowed fp32 (weights past 1.8e19)."""
    n = float(torch.linalg.vector_norm(v))
    return n if math.isfinite(n) else float(torch.linalg.vector_norm(v, dtype=torch.float64))


def growth(st, lr: float, optim, exact: bool) -> tuple[float, float]:
    """(a, b) with |w_new| <= a |w| + b for every weight of unit state `st` at this step (host_state.update_bound);
    `exact`: the exact host policy's moments."""
    t = (int(st.steps[0]) + 1) if st.steps else 1
    wd = optim.weight_decay if any(st.decay) else 0.0
    return max(1.0, abs(1 - lr * wd)), lr * update_bound(optim, t, exact)


def overflow(st, lr: float, optim, exact: bool) -> str | None:
    """Why this step's update of the unit could overflow fp32, or None when it cannot."""
    if not st.owned:
        return None
    if st.bound is None:
        st.bound = math.hypot(*(_norm(v) for v in st.master_views()))
    a, b = growth(st, lr, optim, exact)
    if st.bound * a + b < SAFE_MAX:
        return None
    return f"the update of {st.unit.name} could overflow fp32 (learning rate {lr:.3g}, weights up to {st.bound:.3g})"


def step_fault(losses, grad_norm: float, states, lr: float | None, optim, exact: bool) -> str | None:
    """The verdict of a clip_grads barrier, for every unit of the step before any of them changes: a
    non-finite loss, a non-finite global norm (a norm that overflows fp32 counts too), or an update of any
    unit (`states`) that could overflow."""
    bad = [float(x) for x in losses or () if not math.isfinite(float(x))]
    if bad:
        return f"the loss is {bad[0]}"
    if not math.isfinite(grad_norm):
        return f"the gradients are not finite (global norm {grad_norm})"
    if lr is None:
        return None
    return next((why for st in states if (why := overflow(st, lr, optim, exact)) is not None), None)


def unit_fault(st, norms: list[torch.Tensor], lr: float, optim, exact: bool) -> str | None:
    """The verdict of one unit's step where no barrier checked it: its norms (the device's and `norms`, those of
    its merged tied gradients) are finite, and its update cannot overflow."""
    if not bool(torch.isfinite(torch.stack([*st.norms.unbind(), *norms])).all()):
        return f"the gradients of {st.unit.name} are not finite"
    return overflow(st, lr, optim, exact)
