"""Trainer: the whole pipeline for one training run, from a RunConfig to trained weights and metrics.

Where it sits: the top of the runtime. trace (ir/) -> plan (planner/) -> emit + load (codegen/) -> Engine on
a device (sim or cuda) with the host store. `megatrain train` is a thin CLI over it; `make demo` runs it.
Try it: `megatrain train --model tiny --device sim --gpu-mem 6MiB --steps 20 --seq-len 64 --micro-batch 2`,
or from Python: `Trainer(RunConfig.from_settings({"model": "tiny", "device": "sim", "gpu-mem": "6MiB",
"seq-len": 64, "steps": 20, "data": "train.bin"})).run(20)`.

The run's settings are one RunConfig (config.py): what the CLI prints, what every checkpoint manifest stores
and what a run file holds. This module orchestrates; each concern has its module: building the run
(build.py: model, data, device, plan, store, engine), checkpoints and resume (checkpointer.py), the metrics
log (metrics.py) and preemption (signals.py: SIGTERM/SIGINT stop after the step in flight with a checkpoint).
A periodic checkpoint but the run's last is written by the next step while it trains (the planner's
checkpointing step, planner/checkpoint_writes.py, run instead of the step program; checkpoint_stream.py): its
seal is noted after the step, and every synchronous save (the last, a stop signal's, one by hand) and the run's
end wait for it first.
A resume reads the checkpoint's unit files while the first step trains (the planner's resume step,
planner/checkpoint_reads.py, run instead of the step program once; checkpointer.py `begin_resume`): the
manifest's checks, the RNG states and the data position come before it, and anything that reads the host
store before that step (`store`, a save by hand, a validation pass) reads the rest of the files first, as a
resume did before. A file that fails its check in that step stops it with the file's one-line CheckpointError.

Numerical faults (`on_nan`): a NaN or inf in a step's loss or gradients is never applied (HostStore
`check_finite`). "abort" raises NumericalFault (a ValueError: one line from the CLI) and writes no checkpoint
from that state; "skip" logs the step and goes on. A skip must be all or nothing for the step, so with
"skip" the program is planned with the planner's barrier (the host optimizer starts once every gradient has
landed, in forward order) even without clipping; see docs/CHECKPOINTS.md for the cost.

Metrics (metrics.py): one JSON record per logged step (loss, lr, step time, tokens/s, device peaks, grad norm,
validation loss), in a log of the run's own (a new run refuses a file holding records; a resumed run appends),
and with `tensorboard` as TensorBoard scalars too. Each record also carries the time to the first step: the host store's creation as measured
(`time_to_first_step_s`: first touch and initial weights, not a checkpoint's or model folder's load) beside
the plan's `predicted_time_to_first_step_s` (planner/creation.py). MoE models add the step's routing
metrics (models/routing.py `summarize`): `moe_layers` (per MoE block: per-expert load fractions, experts per
token, zero-expert share, capacity drop and pad rates, max/mean load, aux loss) and their averages over blocks
as `moe_*`.

Data parallelism (`comm`, a distributed.Communicator: under torchrun every rank builds its own Trainer): the
plan is one rank's step of the world (planner/world.py), the host store the rank's shard (sharded_store.py),
each step's batch the global step's (every rank draws the same `batch(step)` and runs its group of it),
checkpoints sharded with one manifest (sharded_checkpoint.py), resumable at any world size. Rank 0 alone
writes metrics, shows progress and holds the checkpoint folder's lock; a stop signal on any rank stops every
rank after the same step.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch

from megatrain.codegen import emit, load
from megatrain.planner import Plan

from . import build
from . import metrics as metric_logs
from .build import HOST_MEM_ENV, HostMemoryError, available_host_bytes  # noqa: F401  (part of this module's API)
from .checkpoint import check_policy, manifest_policy
from .checkpointer import Checkpointer
from .config import RunConfig
from .data import eval_batches
from .evaluation import evaluate
from .examples import example_eval_batches
from .hf_load import check_weights, load_weights
from .metrics import MetricsLog, check_new_log, progress_info
from .optim import lr_at
from .signals import Preempted, stop_signals, stop_vote
from .stream_device import Device, DeviceError
from .tensorfiles import CheckpointError


class NumericalFault(ValueError):
    """A NaN or inf in a step's loss or gradients under on_nan="abort"."""


class Trainer:
    """Plans, compiles and runs streamed training of `config`; one record of metrics per logged step.
    Beside the settings, what is not a setting: `comm` (a distributed.Communicator under torchrun), `plan` (a
    Plan made beforehand, used instead of planning) and `delays` (the sim device's random stream delays, which
    make ordering bugs show as wrong results in tests)."""

    def __init__(self, config: RunConfig, *, comm=None, plan: Plan | None = None,
                 delays: tuple[float, float] | None = None):
        if not isinstance(config, RunConfig):
            raise ValueError(f"Trainer takes a RunConfig (megatrain.runtime.config), got {type(config).__name__}")
        self.run_config = cfg = config
        self.train, self.on_nan = cfg.train, cfg.on_nan
        self.comm, self.rank = comm, comm.rank if comm is not None else 0
        self._closed = False
        self.step = 0
        self.events: list[dict] = []  # skipped steps under on_nan="skip"
        self.plan_changed = False  # resumed under a different program (fine: the math does not depend on it)
        self.profile_note = ""  # how the plan's op costs were obtained (the CLI prints it)
        self.metrics_path = Path(cfg.metrics) if cfg.metrics and self.rank == 0 else None
        self._scalars = None  # the TensorBoard writer, opened by the first run()
        self._metrics: MetricsLog | None = None  # the log of the run() in progress
        self._last_final: float | None = None  # when the last completed record's step was final
        # checkpoints written while training goes on (checkpoint_stream.py): the checkpointing step program, the
        # step whose state the next step is to write, and the writes not yet sealed
        self._writing_program, self.checkpoint_note = None, ""
        self._write_due = False
        self._writes: list = []
        # a resume's first step reads the checkpoint while it trains (checkpointer.py `begin_resume`): its program and
        # the Loading its reads take, until that step (or a reader of the store) takes them
        self._resume_program, self._resume_job, self.resume_note = None, None, ""
        self._resume_failed = False  # that step stopped on a bad file: close() leaves the failed device be
        self._store = None
        # Cheap checks first: a bad data file or checkpoint is reported before anything big is allocated.
        self.config, self.model_dir = build.model_of(cfg)
        self.data, self.val_data, self.pack, self.batcher = build.data_of(cfg, self.config, self.model_dir)
        self.device: Device | None = None
        self.checkpoints = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_checkpoints, comm)
        try:
            self._build(cfg, plan, delays)
        except BaseException:
            if self.device is not None:
                self.device.close()
            self.checkpoints.release()
            raise

    def _build(self, cfg: RunConfig, the_plan: Plan | None, delays) -> None:
        manifest = None
        if cfg.resume is not None:
            manifest = self.checkpoints.check_resume(cfg.resume, self.config, self.train, self.batcher,
                                                     cfg.allow_data_change, cfg.allow_schedule_change)
        host_policy = cfg.host_policy
        if manifest is not None:  # auto resumes under the checkpoint's host policy; another one is refused
            if host_policy != "auto":
                check_policy(manifest, host_policy, self.resumed_from)
            host_policy = manifest_policy(manifest, self.resumed_from)
        self.host_policy = host_policy
        self.checkpoints.check_folder()
        if self.rank == 0:  # after the checkpoint folder: a second run on it is told of the run holding it first
            # a new run's log is its own; TensorBoard is an optional extra: both said before the plan
            check_new_log(self.metrics_path, resuming=cfg.resume is not None)
            if cfg.tensorboard:
                metric_logs.tensorboard_writer(check_only=True)
        self.weights = check_weights(self.model_dir, self.config) if self.model_dir and manifest is None else None
        kind = build.device_kind(cfg.device)
        self.device = build.device_of(cfg, kind, self.comm, delays)
        build.check_compile(cfg, self.config, self.device)
        self.hardware = build.hardware_of(cfg, kind, self.comm)
        if the_plan is None:
            the_plan, self.hardware, self.profile_note = build.plan_of(cfg, self.config, self.device, self.hardware,
                                                                       host_policy, self.pack, self.comm)
        if self.on_nan == "skip" and not any(i.op == "clip_grads" for i in the_plan.program.instrs):
            raise ValueError("on_nan='skip' needs a program with a clip_grads barrier (a step is skipped whole); "
                             "let the Trainer plan, or plan with barrier=True")
        self.plan = the_plan
        self.source = emit(self.plan)
        self.program = load(self.source)
        build.check_memory(self.plan, self.device, self.comm)
        init = cfg.resume is None and self.weights is None
        self._store, self.time_to_first_step_s = build.store_of(self.plan, cfg, self.device, init, self.batcher,
                                                               self.comm)
        self.checkpoints.check_space(self._store)
        self.engine = build.engine_of(self.plan, cfg, self.device, self._store, self.comm)
        self._writing_program, self.checkpoint_note = self.checkpoints.streamed(self.plan, self.plan.ir)
        if self.weights is not None:
            load_weights(self.weights, self._store)
        if manifest is not None:
            self._resume_program, self._resume_job, self.resume_note = self.checkpoints.begin_resume(
                manifest, self.plan, self.engine, self.device)
            if self.resume_note and self.rank == 0:  # where the plan does not allow it: said once
                print(f"note: {self.resume_note}", file=sys.stderr, flush=True)
            self.step = manifest["step"]
            self.engine.step_index = self.step  # the device treats the previous step's events as done
            if self.rank == 0 and (n := metric_logs.drop_redone(self.metrics_path, self.step)):
                print(f"--metrics {self.metrics_path}: {n} record(s) of steps after {self.step} left the log "
                      "(this run redoes those steps)", file=sys.stderr, flush=True)
            self.plan_changed = manifest.get("plan_sha256") != self.plan_sha256
        else:  # NOTE: training draws no random numbers today; if it ever does, a run stays a function of
            torch.manual_seed(self.train.seed)  # (seed, step): seeded here, restored from a checkpoint on resume

    @property
    def store(self):
        """The host store (store.py). Before a resumed run's first step, reading it reads the checkpoint's unit
        files that step would have streamed in, here, as a resume did before (`settle_resume`)."""
        self.settle_resume()
        return self._store

    def settle_resume(self) -> None:
        """Read the rest of the checkpoint resumed from into the host store now, on this thread, instead of in
        the first step; that step then runs the step program. A no-op once the store holds it."""
        job = self._resume_job
        if job is None:
            return
        self._resume_program = self._resume_job = None
        for unit in job.unit_files:
            if unit not in job.loaded:
                self.engine.read_unit(job, unit, mirror=True)

    @property
    def resumed_from(self) -> Path | None:
        return self.checkpoints.resumed_from

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpoints.last

    @property
    def plan_sha256(self) -> str:
        return build.plan_sha256(self.plan)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Drain the device, refuse a faulty state, write checkpoint `self.step`; returns its folder."""
        if self.checkpoints.folder is None:
            raise ValueError("no checkpoint_dir: pass checkpoint_dir=DIR (--checkpoint-dir)")
        self.device.synchronize()  # the disk stream too: the checkpoints being written are sealed first
        self._collect_writes()
        self._handle_faults()
        self._write_due = False  # written here, whole
        return self.checkpoints.save(self.step, self.store, self.device, self._meta(), self.model_dir)

    def _meta(self) -> dict:
        """The manifest's fields of a checkpoint of the current step."""
        return {"model": self.config.model_dump(), "train": self.train.model_dump(mode="json"),
                **({"data": self.batcher.state(self.step)} if self.batcher else {}),  # none without data
                "plan_sha256": self.plan_sha256,
                "run": {"device": self.device.kind, "gpu_budget_bytes": self.plan.gpu_budget_bytes,
                        "hardware": self.hardware.name, "on_nan": self.on_nan},
                "settings": self.run_config.settings(),
                "source": {"hf_dir": str(self.model_dir.resolve())} if self.model_dir else None}

    def _collect_writes(self) -> None:
        """Take note of the checkpoints the checkpointing steps have sealed; raise the first that failed."""
        self._writes = self.checkpoints.collect(self._writes, self._store)

    def checkpoint_bytes(self) -> int:
        return self.checkpoints.checkpoint_bytes(self._store)

    def host_bytes(self) -> int:
        """Every host byte the store allocated (a size: nothing of a resume is read for it)."""
        return self._store.host_bytes()

    def _kept(self) -> str:
        """What a run that stops now keeps, for its error's one line."""
        return (f"the last checkpoint, {self.last_checkpoint}, is intact" if self.last_checkpoint
                else "no checkpoint had been written (--checkpoint-every N keeps one)")

    # -- numerical faults --------------------------------------------------------------------------------------
    def _handle_faults(self, loss: float | None = None) -> None:
        """Abort on a fault, or log the skipped steps. Faults of a step may surface a step later (the host
        optimizer runs behind the compute), and always by the next synchronize."""
        faults = [(step + 1, what) for step, what in self.engine.take_faults()]
        if self.on_nan == "abort":
            if loss is not None and not math.isfinite(loss):
                faults.insert(0, (self.step, f"the loss is {loss}"))
            if faults:
                step, what = min(faults, key=lambda f: f[0])  # the first fault; the loss before its gradients
                with contextlib.suppress(Exception):  # a checkpoint being written from before the fault is sealed
                    self.device.synchronize("disk")
                    self._collect_writes()
                kept = self._kept()
                raise NumericalFault(
                    f"step {step}: {what}; training stopped (--on-nan abort) without writing a checkpoint from "
                    f"this state, and {kept}; lower --lr, set --clip-norm, check the data, or pass --on-nan "
                    "skip to skip such steps")
            return
        for step, what in faults:
            event = {"step": step, "event": "skipped", "reason": f"{what}: no update applied (--on-nan skip)"}
            self.events.append(event)
            if self._metrics is not None:
                self._metrics.write(event)
            print(f"step {step}: {event['reason']}", file=sys.stderr, flush=True)

    # -- training ----------------------------------------------------------------------------------------------
    @property
    def planned_peak_device_bytes(self) -> int:
        """What the device's measured allocated peak is compared with: program buffers on sim (the pool counts
        them exactly), buffers and workspace on cuda (max_memory_allocated: no reserve, no allocator margin)."""
        return self.plan.peak_buffer_bytes if self.device.kind == "sim" else self.plan.peak_device_bytes

    def planned_memory(self) -> dict[str, int]:
        """The plan's figures beside the device's memory_report(), like with like: `planned_peak_device_bytes`
        with `peak_device_bytes`; on cuda `planned_peak_reserved_bytes` (buffers and workspace with the
        allocator margin) with `peak_reserved_bytes`, and `planned_peak_gpu_bytes` (with the reserve for the
        context) with `device_used_bytes`; `gpu_budget_bytes`, which the process is held to."""
        out = {"planned_peak_device_bytes": self.planned_peak_device_bytes,
               "gpu_budget_bytes": self.plan.gpu_budget_bytes}
        if self.device.kind != "sim":
            hw = self.plan.hardware
            out["planned_peak_reserved_bytes"] = self.plan.peak_gpu_bytes - hw.reserved_bytes
            out["planned_peak_gpu_bytes"] = self.plan.peak_gpu_bytes
        return out

    def train_step(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        lr = lr_at(self.train, self.step)
        program = self.program
        if self._resume_job is not None:  # the first step after a resume reads the checkpoint while it trains
            return self._resume_step(batch, lr)
        if self._write_due:  # the state this step starts from is a checkpoint due: this step writes it
            self._write_due = False
            job = self.checkpoints.job(self.step, self.engine.step_index - 1, self._store, self.device, self._meta(),
                                       self.model_dir, self.on_nan == "abort")
            self.engine.write_checkpoint(job)
            self._writes.append(job)
            program = self._writing_program
        loss = program.step(self.engine, batch, lr)
        self.step += 1
        return loss

    def _resume_step(self, batch, lr: float) -> float:
        """The resume step (planner/checkpoint_reads.py): the step program with the checkpoint's reads on the disk
        stream. A file that fails its check (a flipped byte, an I/O error) fails the device, so no stream waits
        for it; its one-line CheckpointError is raised, and nothing is written anywhere."""
        program, job = self._resume_program, self._resume_job
        self._resume_program = self._resume_job = None
        self.engine.read_checkpoint(job)
        try:
            loss = program.step(self.engine, batch, lr)
            self.device.synchronize("disk")  # every read is in by now (the step's loads waited for them)
        except DeviceError as e:
            if isinstance(e.__cause__, CheckpointError):
                self._resume_failed = True
                raise e.__cause__ from None
            raise
        finally:
            self.engine.read_checkpoint(None)
        self.step += 1
        return loss

    def validation_loss(self, n_batches: int = 4) -> float | None:
        if self.val_data is None:
            return None
        self.settle_resume()  # the evaluation program reads the store
        t = self.train
        if self.val_data.examples is not None:
            return evaluate(self.engine, example_eval_batches(self.val_data, t.micro_batch, t.seq_len, n_batches,
                                                              pack=self.pack))
        return evaluate(self.engine, eval_batches(self.val_data, t.micro_batch, t.seq_len, n_batches))

    def run(self, steps: int | None = None, log_every: int | None = None, eval_every: int | None = None,
            progress: bool | None = None, handle_signals: bool = True) -> list[dict]:
        """Train `steps` optimizer steps from the current step (default: the rest of the configured run, to
        `train.total_steps`); returns the logged records (`log_every`,
        `eval_every` and `progress` default to the RunConfig's). Checkpoints every `checkpoint_every` steps
        and after the last one. With `handle_signals` (in the main thread), SIGTERM and SIGINT stop the run
        after the step in flight: a checkpoint is written when checkpointing is configured and `Preempted` is
        raised; a second signal ends the process at once."""
        cfg = self.run_config
        steps = self.train.total_steps - self.step if steps is None else steps
        log_every = cfg.log_every if log_every is None else log_every
        eval_every = cfg.eval_every if eval_every is None else eval_every
        progress = not cfg.no_progress if progress is None else progress
        if self._closed:
            raise ValueError("this Trainer is closed: build a new one (resume=DIR continues from a checkpoint)")
        if self.batcher is None:
            raise ValueError("no training data: pass data=PATH (see `megatrain prepare`), or the built-in corpus the "
                             "CLI trains on: data, val_data = megatrain.runtime.build.default_corpus(model)")
        for name, value, least in (("steps", steps, 0), ("log_every", log_every, 1), ("eval_every", eval_every, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if eval_every and self.val_data is None:
            raise ValueError(f"eval_every={eval_every} needs validation data: pass val_data=PATH (--val-data)")
        if self.step + steps > self.train.total_steps:
            raise ValueError(f"{steps} more step(s) from step {self.step} pass the run's total_steps "
                             f"{self.train.total_steps} (where its learning-rate schedule ends): train at most "
                             f"{self.train.total_steps - self.step} more, or set a larger total_steps (--steps)")
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        cols = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn()]
        last = self.step + steps
        if cfg.tensorboard and self.rank == 0 and self._scalars is None:
            self._scalars = metric_logs.tensorboard_writer(cfg.tensorboard)
        log = MetricsLog(self.engine, self.train.tokens_per_step, log_every, self._last_final, self._scalars,
                         kept=self._kept)
        with log.writing(self.metrics_path), stop_signals(handle_signals) as stop, \
                Progress(*cols, disable=not (progress and self.rank == 0)) as bar:
            self._metrics = log
            task = bar.add_task("train", total=last, completed=self.step, info="")

            def finish(block: bool) -> None:
                for rec in log.finish(block):
                    bar.update(task, info=progress_info(rec, self.planned_peak_device_bytes))

            try:
                for _ in range(steps):
                    log.add(self._logged_step(eval_every))
                    finish(block=len(log.open) > 1)
                    self._collect_writes()
                    saved = self.checkpoints.due(self.step, last)
                    if saved and self._writing_program is not None and self.step < last:
                        self._write_due, saved = True, False  # the next step writes it while it trains
                    elif saved:
                        self.save_checkpoint()
                        finish(block=True)
                    bar.update(task, advance=1)
                    signum = stop_vote(stop, self.comm)  # every rank stops after the same step
                    if signum is not None:
                        self._stop(signum, saved, finish)
                self.device.synchronize()
                self._collect_writes()
                finish(block=True)
                self._handle_faults()
            finally:
                with contextlib.suppress(Exception):  # the steps before a fault keep their records
                    finish(block=True)
                self._metrics, self._last_final = None, log.last_final
        return log.logged

    def _stop(self, signum: int, saved: bool, finish) -> None:
        """A stop signal came: drain, checkpoint this step when checkpointing is configured, raise Preempted."""
        self.device.synchronize()
        self._collect_writes()
        finish(block=True)
        self._handle_faults()
        if self.checkpoints.every and not saved:
            self.save_checkpoint()
        raise Preempted(signum, self.step, self.last_checkpoint if self.checkpoints.every else None)

    def _logged_step(self, eval_every: int) -> dict:
        """One training step and its metrics record, whose timing the metrics log completes."""
        start = time.perf_counter()
        loss = self.train_step(self.batcher.batch(self.step))
        computed = time.perf_counter() - start
        self._handle_faults(loss)
        rec = {"step": self.step, "loss": loss, "lr": lr_at(self.train, self.step - 1),
               "compute_time_s": computed, **self.device.memory_report(), **self.planned_memory(),
               "predicted_step_time_s": self.plan.step_time_s, "time_to_first_step_s": self.time_to_first_step_s,
               "predicted_time_to_first_step_s": self.plan.time_to_first_step_s, "_start": start,
               "_index": self.engine.step_index - 1}
        if eval_every and self.step % eval_every == 0:
            rec["val_loss"] = self.validation_loss()
        norm = self.engine.grad_norm()  # this step's, once its clip_grads has run (the host stream may lag)
        if norm is not None:
            rec["grad_norm"] = norm
        rec.update(self.engine.routing_metrics())
        return rec

    def close(self) -> None:
        """Drain the device and free it, the store and the checkpoint folder's lock; a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(DeviceError) if self._resume_failed else contextlib.nullcontext():
                self.device.synchronize()  # (a resume's bad file failed the device: raised already)
        finally:
            self.device.close()
            self.checkpoints.release()
            if self._scalars is not None:
                self._scalars.close()
            if getattr(self, "_store", None) is not None:
                self._store.close()  # unregisters pinned host memory on cuda; the tensors stay readable

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
