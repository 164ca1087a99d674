"""What the ranks of tests/runtime/test_distributed.py run (imported in each spawned process)."""

from __future__ import annotations

from pathlib import Path

from megatrain.codegen import emit, load
from megatrain.ir.trace import trace
from megatrain.models import ModelConfig
from megatrain.planner import TrainSpec, hardware_preset, plan
from megatrain.planner.world import World
from megatrain.runtime.engine import Engine
from megatrain.runtime.optim import lr_at
from megatrain.runtime.sharded_store import ShardedHostStore
from megatrain.runtime.stream_device import SimDevice


def streamed(comm, config: dict, train: dict, budget: int, batches, policy: str = "exact", delays=None,
             resident="none", hardware: dict | None = None) -> dict:
    """Train `batches` (global steps) on this rank of the world; returns the whole masters and buffers (every
    rank gathers them), the losses, and this rank's host bytes beside the plan's. `resident`: plan()'s;
    `hardware`: fields of the cpu preset to plan with instead (what auto's choice reads)."""
    config, train = ModelConfig.model_validate(config), TrainSpec.model_validate(train)
    ir = trace(config, train.micro_batch, train.seq_len, train.dtype, target="cpu")
    p = plan(ir, hardware_preset("cpu").replace(**(hardware or {})), train, budget, host_policy=policy,
             world=World(nproc=comm.size), resident=resident)
    step = load(emit(p)).step
    with SimDevice(budget_bytes=p.gpu_budget_bytes, delays=delays, seed=comm.rank) as dev:
        store = ShardedHostStore(p.ir, p.train, seed=train.seed, policy=p.host_policy, program=p.program,
                                 comm=comm, device=dev.kind)
        engine = Engine(p.ir, p.program, dev, store, comm=comm)
        losses = [step(engine, b, lr_at(p.train, i)) for i, b in enumerate(batches)]
        dev.synchronize()
        master = {k: v.clone() for k, v in store.full_master().items()}
        return {"master": master, "buffers": {k: v.clone() for k, v in store.full_buffers().items()},
                "losses": losses, "rank": comm.rank, "host_bytes": store.host_bytes(), "plan_host_bytes": p.host_bytes_per_rank,
                "peak": dev.pool.peak, "plan_peak": p.peak_buffer_bytes, "n_slots": p.n_slots,
                "placements": sorted(set(p.placement.values())), "state_place": dict(p.state_place),
                "collectives": sorted({i.op for i in p.program.instrs if i.stream == "comm"} - {"record", "wait"})}


def config_of(**changes) -> dict:
    from megatrain.models import preset

    return ModelConfig(**{**preset("tiny").model_dump(), **changes}).model_dump()


def global_batches(config: dict, train: dict, steps: int, seed: int = 0):
    from runtime_schedules import make_batches

    return make_batches(ModelConfig.model_validate(config), TrainSpec.model_validate(train), steps, seed)


def resume_and_train(comm, data: str, ckpt: str, steps: int = 4) -> dict:
    """Resume the CLI run of test_distributed's checkpoint test from `ckpt` on this world: the weights it
    resumed with, and those after training to `steps` (checkpointing into `ckpt` as it goes)."""
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    train = TrainSpec(micro_batch=1, seq_len=32, grad_accum=6, dtype="fp32", lr=3e-3, warmup_steps=1,
                      total_steps=steps, clip_norm=1.0)
    run = RunConfig(model="tiny", train=train, gpu_mem=8 * 2**20, hardware="cpu", device="sim", data=data,
                    checkpoint_dir=ckpt, checkpoint_every=2, resume=ckpt)
    with Trainer(run, comm=comm) as trainer:
        resumed = {k: v.clone() for k, v in trainer.store.full_master().items()}
        trainer.run(steps - trainer.step, progress=False, handle_signals=False)
        trained = {k: v.clone() for k, v in trainer.store.full_master().items()}
    return {"resumed": resumed, "trained": trained}


def resident_resume(comm, config: dict, train: dict, budget: int, batches, resident, ckpt: str) -> dict:
    """Train `batches` with `resident` units on this rank, saving a sharded checkpoint after the first
    len(batches) - 1 steps; then resume that checkpoint in a fresh store and engine and run the last step. Both
    runs' final states on this rank (every unit's shard or whole state) and the gathered masters, and the
    uninterrupted run's losses and buffers."""
    from megatrain.runtime import checkpoint, sharded_checkpoint
    from megatrain.runtime.evaluation import evaluate

    config, train = ModelConfig.model_validate(config), TrainSpec.model_validate(train)
    ir = trace(config, train.micro_batch, train.seq_len, train.dtype, target="cpu")
    p = plan(ir, hardware_preset("cpu"), train, budget, host_policy="exact", world=World(nproc=comm.size),
             resident=resident)
    step, last = load(emit(p)).step, len(batches) - 1
    meta = {"model": config.model_dump(), "train": train.model_dump(mode="json")}

    def run(init: bool, steps: range, save: bool = False):
        with SimDevice(budget_bytes=p.gpu_budget_bytes, seed=comm.rank) as dev:
            store = ShardedHostStore(p.ir, p.train, seed=train.seed, policy=p.host_policy, program=p.program,
                                     comm=comm, device=dev.kind, init=init)
            engine = Engine(p.ir, p.program, dev, store, comm=comm)
            if not init:  # the mirror is written: the engine uploads it at the next step
                saved = sorted(Path(ckpt).glob("step-*"))[-1]
                sharded_checkpoint.load(saved, checkpoint.read_manifest(saved), store, comm)
                engine.step_index = steps.start
            losses = []
            for i in steps:
                losses.append(step(engine, batches[i], lr_at(p.train, i)))
                if save and i == last - 1:
                    dev.synchronize()
                    sharded_checkpoint.save(ckpt, last, store, meta, comm)  # the store pulls the device state
                    val.append(evaluate(engine, batches[last]))  # the weights the last step's loss sees
            dev.synchronize()
            state = {f"{u}/{k}": v.clone() for u in store.units for k, v in (
                store.shard_state(u) if u in store.sharded else store.state_tensors(u)).items()}
            return state, {k: v.clone() for k, v in store.full_master().items()}, losses, {
                k: v.clone() for k, v in store.full_buffers().items()}

    val: list[float] = []
    whole, master, losses, buffers = run(True, range(len(batches)), save=True)
    resumed, resumed_master, _, _ = run(False, range(last, len(batches)))
    return {"whole": whole, "master": master, "losses": losses, "buffers": buffers, "val": val[0], "resumed": resumed,
            "resumed_master": resumed_master, "resident": {k: v for k, v in p.state_place.items() if v != "host"}}
