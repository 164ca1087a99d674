"""Store creation, the time to the first step: the host store created as before megatrain/runtime/host_init.py (`before`:
UnitState zero-filled master, moments, scales, step counts and buffers with torch's zero_ on the calling thread
and its intra-op threads, then the initial weights were drawn) and as now (`after`: every page touched on the
creation pool, zero-filled only where zero is the initial value; `after-1`: the same on one thread), with the
planner's prediction.

Run: `.venv/bin/python benchmarks/bench_store_creation.py` (about 8 minutes: the 1b preset under the
bf16-moments policy, an 8.7 GiB store, 3 rounds of each; `--model`, `--policy`, `--rounds`). Results:
docs/RESULTS.md, "Store creation (time to first step)".

`before` is a subclass of today's HostStore that does what the old creation did (`_old_store`), so the rest of
the tree is the same for all three. NOTE: `before` left the host gradient ring and the staging ring untouched
(the first step faulted them in); `after` touches them too, so it does more of the work before the first step.
Each creation runs in a fresh process, the variants' order alternating round by round: on a VM whose freed
memory goes back to the host (free page reporting), a first touch is a fault in the hypervisor too, and how
slow that is drifts from run to run. Figures: seconds from allocation to initialised masters (`total_s`), of
which drawing the initial weights (`init_s`), and `predicted_s`, the plan's time_to_first_step_s (cpu preset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("before", "after", "after-1")


def _plan(model: str, policy: str, seq_len: int):
    from megatrain.ir.trace import trace
    from megatrain.models import load_model_config
    from megatrain.planner import TrainSpec, plan

    train = TrainSpec(micro_batch=1, seq_len=seq_len, dtype="bf16")
    ir = trace(load_model_config(model), 1, seq_len, "bf16", target="cpu")
    return plan(ir, "cpu", train, "2GiB", host_policy=policy), train


def _old_store():
    """HostStore as it created its buffers before host_init.py: UnitState zero-filled master, moments, scales,
    step counts and buffers on the calling thread, the host gradient buffers left to the first step."""
    from megatrain.runtime import store

    class OldUnitState(store.UnitState):
        def __init__(self, unit, bufs, policy, norms):
            for kind in ("master", "exp_avg", "exp_avg_sq", "scales", "steps", "buffers"):
                if f"{kind}.{unit.name}" in bufs:
                    bufs[f"{kind}.{unit.name}"].zero_()
            super().__init__(unit, bufs, policy, norms)

    class OldStore(store.HostStore):
        def __init__(self, *a, **kw):
            prepare, unit_state = store.host_init.prepare, store.UnitState
            store.host_init.prepare = lambda *a, **kw: None
            store.UnitState = OldUnitState
            try:
                super().__init__(*a, **kw)
            finally:
                store.host_init.prepare, store.UnitState = prepare, unit_state

    return OldStore


def one(variant: str, planned) -> dict:
    """Create the store of `planned` (a plan and its TrainSpec) once as `variant` does; its figures."""
    import gc

    from megatrain.runtime import host_init
    from megatrain.runtime.store import HostStore

    p, train = planned
    cls = _old_store() if variant == "before" else HostStore
    drawn, init, threads = {}, HostStore._init, host_init.creation_threads
    if variant == "after-1":  # the same work on one thread: what the pool adds
        host_init.creation_threads = lambda: 1

    def timed_init(self, seed):
        t = time.perf_counter()
        init(self, seed)
        drawn["s"] = time.perf_counter() - t

    HostStore._init = timed_init
    try:
        t = time.perf_counter()
        store = cls(p.ir, train, seed=0, policy=p.host_policy, program=p.program, device="sim")
        total = time.perf_counter() - t
        row = {"variant": variant, "model": p.ir.model, "policy": p.host_policy, "host_bytes": store.host_bytes(),
               "total_s": total, "init_s": drawn["s"], "predicted_s": p.time_to_first_step_s,
               "threads": host_init.creation_threads()}
    finally:
        HostStore._init, host_init.creation_threads = init, threads
    del store
    gc.collect()
    return row


def _print(r: int, row: dict) -> None:
    print(f"round {r} {row['variant']:7} {row['host_bytes'] / 2**30:.2f} GiB: {row['total_s']:.2f} s (initial "
          f"weights {row['init_s']:.2f} s; predicted {row['predicted_s']:.2f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--policy", default="bf16-moments")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--hot", action="store_true", help="create every store in this one process, back to back: "
                    "pages the previous store freed a moment ago (the kernel's part of a first touch alone)")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's single creation
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, _plan(args.model, args.policy, args.seq_len))))
        return 0
    rows, planned = [], _plan(args.model, args.policy, args.seq_len) if args.hot else None
    if args.hot:
        one("after", planned)  # the first store meets memory the host took back; the rounds reuse its pages
    for r in range(args.rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            if args.hot:
                rows.append({**one(variant, planned), "round": r})
            else:
                out = subprocess.run([sys.executable, __file__, "--one", variant, "--model", args.model, "--policy",
                                      args.policy, "--seq-len", str(args.seq_len)], capture_output=True, text=True,
                                     check=True, cwd=ROOT).stdout
                rows.append({**json.loads(out.strip().splitlines()[-1]), "round": r})
            _print(r, rows[-1])
    print("\n| variant | median s | min s | max s | initial weights s (median) | predicted s |\n|---|---|---|---|---|---|")
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        total = [r["total_s"] for r in mine]
        print(f"| {variant} | {statistics.median(total):.2f} | {min(total):.2f} | {max(total):.2f} | "
              f"{statistics.median(r['init_s'] for r in mine):.2f} | {mine[0]['predicted_s']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
