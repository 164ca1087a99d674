"""Helpers for runtime tests: plans of the tiny model that cover distinct schedule shapes, and batches."""

from __future__ import annotations

import torch

from megatrain.codegen import emit, load
from megatrain.ir.trace import trace
from megatrain.planner import InfeasiblePlanError, TrainSpec, hardware_preset, plan
from megatrain.runtime.device import make_device
from megatrain.runtime.engine import Engine
from megatrain.runtime.optim import lr_at
from megatrain.runtime.store import HostStore
from megatrain.runtime.stream_device import SimDevice

MIB = 2**20


def shape_of(p) -> tuple[int, frozenset]:
    """(slots, the checkpoint states used: a placement, "+replay" where the unit replays its attention)."""
    return p.n_slots, frozenset(u.placement + ("+replay" if u.replay else "") for u in p.units)


def placements_of(plans) -> set[str]:
    """The checkpoint placements a sweep of plans_by_shape used, with or without attention replay."""
    return {state.removesuffix("+replay") for _, states in plans for state in states}


def plans_by_shape(config, train: TrainSpec, budgets_mib=(3, 4, 5, 5.25, 5.5, 5.75, 6, 7, 8, 10, 12, 16, 24, 64),
                   target="cpu", packed=False, host_policy="auto", replay=True, chunk_tokens=None):
    """{(n_slots, placements used): plan} over a sweep of budgets, smallest budget first.
    target "cpu" for the sim device (it runs CPU kernels), "cuda" for a GPU; `packed` for packed batches;
    `replay=False`: planned as the Trainer plans compiled units, none replaying attention; `chunk_tokens` tiles
    the units."""
    ir = trace(config, train.micro_batch, train.seq_len, train.dtype, target=target, packed=packed,
               chunk_tokens=chunk_tokens)
    ir = ir if replay else ir.without_replay()
    out = {}
    for b in budgets_mib:
        try:
            p = plan(ir, hardware_preset("cpu"), train, int(b * MIB), host_policy=host_policy)
        except InfeasiblePlanError:
            continue
        out.setdefault(shape_of(p), p)
    return out


def make_batches(config, train: TrainSpec, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (train.micro_batch, train.seq_len)
    batches = []
    for _ in range(steps):
        step = []
        for _ in range(train.grad_accum):
            tokens = torch.randint(0, config.vocab_size, shape, generator=g)
            targets = torch.randint(0, config.vocab_size, shape, generator=g)
            targets[0, : train.seq_len // 8] = -100  # some ignored positions
            step.append((tokens, targets))
        batches.append(step)
    return batches


def streamed_train(p, batches, delays=None, budget=None, seed=0, kind="sim", compile_units=False):
    """Run the compiled plan on a device (sim by default); returns (store, losses, pool peak). `delays`: on
    sim (lo, hi) seconds per op, on cuda (lo, hi) GPU cycles slept before each GPU stream op; `compile_units`:
    the units through torch.compile (megatrain/runtime/compiled.py)."""
    step = load(emit(p)).step
    budget = budget if budget is not None else p.gpu_budget_bytes
    if kind == "sim":
        dev = SimDevice(budget_bytes=budget, delays=delays, seed=seed)
    else:
        dev = make_device(kind, budget, **({"gpu_delays": delays, "seed": seed} if delays else {}))
    with dev:
        store = HostStore(p.ir, p.train, seed=p.train.seed, policy=getattr(p, "host_policy", "exact"),
                          program=p.program, device=dev.kind)
        engine = Engine(p.ir, p.program, dev, store, compile_units=compile_units)
        losses = [step(engine, b, lr_at(p.train, i)) for i, b in enumerate(batches)]
        dev.synchronize()
        return store, losses, dev.pool.peak


def make_token_files(root, phrase="the quick brown fox jumps over the lazy dog. "):
    """Small train/val token files from six generated documents (runtime.corpus.prepare)."""
    from megatrain.runtime.corpus import prepare

    docs = root / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"doc{i}.txt").write_text(phrase * 40 + str(i))
    return prepare([docs], root / "data", val_fraction=0.3)


def with_place(p, where: str):
    """Plan `p` with its compute-dtype cast forced to `where` (megatrain/planner/cast.py: host, gpu or copy): the same
    schedule, the program's cast and, for gpu, its device staging buffer, the sim budget grown by that buffer."""
    from types import SimpleNamespace

    from megatrain.planner.cast import device_stage_elems, with_cast

    extra = 4 * device_stage_elems(p.ir) if where == "gpu" else 0
    return SimpleNamespace(ir=p.ir, program=with_cast(p.program, p.ir, where), train=p.train,
                           gpu_budget_bytes=p.gpu_budget_bytes + extra, host_policy=getattr(p, "host_policy", "exact"))
