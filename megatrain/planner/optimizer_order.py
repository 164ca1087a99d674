"""Host optimizer order: which units AdamW steps as their gradients land, and which wait for the next forward.

Where it sits: the `optimizer` pass (passes.py), between `order` and `lower`. Try it:
`megatrain plan --model llama3-70b --hardware h100-sxm --seq-len 8192 --micro-batch 1 --explain`.

Without clipping a unit may step as soon as its gradients land (backward order: head first, embed last),
but the next step's forward needs the units in the opposite order, embed first. Stepping everything in
backward order makes the next forward wait for the whole optimizer; stepping everything after the backward
in forward order leaves the host idle during the backward. So the first `k` units of the backward step as
they land and the rest step after the backward in forward order, with the next forward streaming right
behind them. We pick k by a unit-level simulation of two consecutive steps: the host works through the
first k stores (backward order), then embed and the remaining units (forward order); the next forward
starts each unit once it is stepped and loaded; k minimises the time to the end of the next forward plus
any optimizer backlog left when its gradients start landing. O(N) per k, O(N^2) in all (milliseconds at
120B). With clipping every unit steps after clip_grads, in forward order (docs/DESIGN.md 4.5); there is no choice.
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR

from .costs import CostModel
from .host_policy import HostPolicy, grad_buffer_elems
from .schedule import HOST_GRAD_RING, Decisions, Order, host_grad_assignment


def _period(k: int, bwd_units: list[int], b: list[float], fwd: list[float], load: list[float],
            opt: list[float], store: list[float], tied: frozenset[int] = frozenset(),
            ring: int = HOST_GRAD_RING) -> float:
    """Analytic steady period for split k (times relative to the start of this step's backward). The first k
    units (tied holders aside) take turns in `ring` host gradient buffers: a store waits until the unit that
    used its buffer before has stepped, and the backward behind it (its gradient slot) with it."""
    t, stores = 0.0, {}
    host, done = 0.0, {}
    turns = [i for i in bwd_units[:k] if i not in tied]
    pos = {i: j for j, i in enumerate(turns)}
    landing = set(bwd_units[:k])
    for i in bwd_units:
        t += b[i]
        if pos.get(i, 0) >= ring:
            t = max(t, done[turns[pos[i] - ring]])
        stores[i] = t + store[i]
        if i in landing:
            host = max(host, stores[i]) + opt[i]
            done[i] = host
    for i in sorted(bwd_units[k:]):
        host = max(host, stores[i]) + opt[i]
        done[i] = host
    f = 0.0
    for i in sorted(bwd_units):
        f = max(f, done[i] + load[i]) + fwd[i]
    backlog = max(0.0, host - (f + stores[bwd_units[0]]))  # the next step's first store finds the host busy
    return f + backlog


RING_SLOWDOWN = 0.01  # a larger gradient ring must buy more than this fraction of the period to be taken


def held_grad_bytes(ir: ModelIR, order: Order, policy: HostPolicy, k: int | None,
                    ring: int = HOST_GRAD_RING) -> int:
    """Host bytes of the gradient buffers with split k (None: every unit as its gradients land)."""
    return policy.grad_bytes * sum(grad_buffer_elems(ir, host_grad_assignment(ir, order.backward, False, k, ring)))


def choose_split(ir: ModelIR, costs: CostModel, order: Order, dec: Decisions, policy: HostPolicy | None = None,
                 host_room: int | None = None) -> tuple[int, int, list[str]]:
    """(k, ring): the split in [0, N] and the host gradient ring size (2, 4, 8, ...) minimising the analytic
    period, and the decision lines. With `host_room` (host bytes left for gradient buffers beyond the fewest,
    which the policy's floor counts), only choices whose gradient buffers fit are candidates (every unit
    stepping as it lands, in a ring of two, always fits); a larger ring is taken only when it shortens the
    period by more than RING_SLOWDOWN."""
    K = order.micro_batches
    n = len(ir.units)
    keep = [p == "keep" for p in dec.placement]
    host = [p == "host" and bool(u.carry_in) for p, u in zip(dec.placement, ir.units)]
    b = [max(K * costs.backward(i, keep[i], dec.placement[i] == "rebuild"), (0.0 if i in order.resident else costs.load[i])
             + (K * costs.reload[i] if host[i] else 0.0), costs.store[i]) for i in range(n)]
    fwd = [max(K * costs.fwd[i], K * costs.offload[i] if i + 1 < n and host[i + 1] else 0.0) for i in range(n)]
    bwd_units = list(order.backward)
    tied = frozenset(i for i, u in enumerate(ir.units) if u.tied)
    rings = [HOST_GRAD_RING]
    while rings[-1] < n:
        rings.append(rings[-1] * 2)
    base = held_grad_bytes(ir, order, policy, None) if policy is not None else 0

    def fits(k: int, ring: int) -> bool:
        return (policy is None or host_room is None or (k == n and ring == HOST_GRAD_RING)
                or held_grad_bytes(ir, order, policy, k, ring) - base <= host_room)

    best: dict[int, tuple[float, int]] = {}  # ring -> (period, k)
    periods: dict[int, list[float]] = {}
    for ring in rings:
        periods[ring] = [_period(k, bwd_units, b, fwd, costs.load, costs.opt, costs.store, tied, ring)
                         for k in range(n + 1)]
        allowed = [k for k in range(n + 1) if fits(k, ring)]
        if allowed:
            k = min(allowed, key=lambda k: (periods[ring][k] * (1 - 1e-9 * k), -k))
            best[ring] = (periods[ring][k], k)
    top = min(p for p, _ in best.values())
    ring = min(r for r, (p, _) in best.items() if p <= top * (1 + RING_SLOWDOWN))
    period, split = best[ring]
    names = [ir.units[i].name for i in bwd_units]
    lines = [f"AdamW on host: {sum(costs.opt):.4g} s of work per step "
             f"({ir.units[0].name} alone {costs.opt[0] * 1e3:.4g} ms)"]
    p = periods[ring]
    if split == n:
        lines.append(f"every unit steps as its gradients land (backward order): analytic period {p[n]:.4g} s")
    else:
        first = f"{names[0]} .. {names[split - 1]} " if split else ""
        lines.append(f"{split} unit(s) {first}step as their gradients land, the other {n - split} after the "
                     f"backward in forward order ({names[-1]} first) so the next forward streams behind them: "
                     f"analytic period {p[split]:.4g} s vs {p[n]:.4g} s all-as-they-land, "
                     f"{p[0]:.4g} s all-after")
    if split:
        others = ", ".join(f"{r}: {best[r][0]:.4g} s" for r in sorted(best) if r != ring)
        lines.append(f"they take turns in {ring} host gradient buffers ({others or 'no other ring fits'}; a larger "
                     f"ring must save over {RING_SLOWDOWN:.0%})")
    if policy is not None and host_room is not None and len(best) < len(rings) or not fits(0, HOST_GRAD_RING):
        lines.append(f"host memory leaves {_bytes(host_room or 0)} for gradients that wait: the {policy.name} "
                     "gradient buffers of longer waits or larger rings do not fit")
    return split, ring, lines


def _bytes(n: int) -> str:
    from .bytesize import format_bytes

    return format_bytes(max(0, n))
