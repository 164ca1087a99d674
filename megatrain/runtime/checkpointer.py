"""The Trainer's checkpoints: the folder's lock, resume, saves and the disk space they need.

Where it sits: trainer.py holds one Checkpointer per run; the format is checkpoint.py's (sharded_checkpoint.py
for a world), described in docs/CHECKPOINTS.md. `resume=DIR` loads one and the run continues bit for bit:
the data order is `Batcher.batch(step)` and the learning rate `lr_at(train, step)`, both functions of the
step. One run writes into a checkpoint folder at a time: rank 0 holds its fcntl lock until `release()`.
The unit files of a resume are read while its first step trains (`begin_resume`, planner/checkpoint_reads.py);
a world's sharded checkpoint is read before it (`load`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatrain.planner.bytesize import format_bytes

from . import checkpoint, sharded_checkpoint
from .hf_load import source_files

CHANGEABLE = ("total_steps", "lr")  # TrainSpec fields a resumed run may set anew (the others: exact resume)


def stored_settings(resume: str) -> dict:
    """The settings the checkpoint `resume` names was trained with (its manifest's RunConfig.settings()), less
    those that belong to one invocation, not to the run: where it resumed from, the world's size (a run resumes
    at any), the permissions to change data or schedule, the trace and plot of the steps that invocation took,
    the folder it wrote checkpoints to."""
    ckpt = checkpoint.find_checkpoint(resume)
    stored = checkpoint.read_manifest(ckpt).get("settings")
    if not isinstance(stored, dict):
        raise checkpoint.CheckpointError(f"{ckpt / checkpoint.MANIFEST}: holds no settings (an older megatrain "
                                         "wrote it): pass the run's flags with --resume")
    once = {"resume", "nproc", "nnodes", "allow-data-change", "allow-schedule-change", "trace", "plot",
            "checkpoint-dir"}  # new checkpoints go beside the one resumed from, wherever it was moved
    out = {k: v for k, v in stored.items() if k.replace("_", "-") not in once}
    if isinstance(out.get("model"), dict):  # a run given a ModelConfig or Hardware value (the Python API)
        from megatrain.models import ModelConfig

        out["model"] = ModelConfig.model_validate(out["model"])
    if isinstance(out.get("hardware"), dict):
        from megatrain.planner.hardware import Hardware

        out["hardware"] = Hardware.model_validate(out["hardware"])
    return out


class Checkpointer:
    """Checkpoints of one run into `folder` (None: none), every `every` steps, the last `keep` kept."""

    def __init__(self, folder: str | None, every: int, keep: int | None, comm=None):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"checkpoint_dir {folder} is a file, not a folder: pass a folder for the "
                             "step-NNNNNNNN checkpoints")
        if every and folder is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        self.folder = Path(folder) if folder else None
        self.every, self.keep, self.comm = every, keep, comm
        self.rank = comm.rank if comm is not None else 0
        self.resumed_from: Path | None = None
        self.changes: dict[str, tuple] = {}  # CHANGEABLE fields a resume set anew: (checkpoint's, this run's)
        self.last: Path | None = None  # the latest checkpoint written or resumed from
        self.lock = checkpoint.FolderLock(self.folder).acquire() if self.folder and every and self.rank == 0 else None

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)

    # -- resume ------------------------------------------------------------------------------------------------
    def check_resume(self, resume: str, config, train, batcher, allow_data_change: bool,
                     allow_schedule_change: bool = False) -> dict:
        """The manifest of the checkpoint `resume` names, checked against this run's model, settings and data;
        with `allow_schedule_change` the CHANGEABLE settings may differ (recorded in `changes`)."""
        ckpt = checkpoint.find_checkpoint(resume)
        manifest = checkpoint.read_manifest(ckpt)
        checkpoint.check_model(manifest, config, ckpt)
        theirs = manifest["train"] if isinstance(manifest["train"], dict) else {}
        # the schedule's length and peak may change (a run extended, its learning rate lowered): the steps
        # taken are the same bits either way, and every later step's lr is lr_at(train, step) of this run's
        self.changes = {k: (theirs[k], getattr(train, k)) for k in CHANGEABLE
                        if allow_schedule_change and k in theirs and theirs[k] != getattr(train, k)}
        checkpoint.check_train({**manifest, "train": {**theirs, **{k: getattr(train, k) for k in self.changes}}},
                               train, ckpt)
        if batcher is not None and "data" not in manifest:
            raise checkpoint.CheckpointError(
                f"{ckpt / checkpoint.MANIFEST}: holds no data position (it was saved without training data), so "
                "training cannot continue its data order from it; `megatrain export` it and start a run from the "
                "export with --model")
        if batcher is not None:
            try:
                batcher.check_state(manifest["data"], allow_data_change)
            except ValueError as e:
                raise checkpoint.CheckpointError(f"{ckpt / checkpoint.MANIFEST}: {e}") from None
        self.resumed_from = self.last = ckpt
        return manifest

    def check_folder(self) -> None:
        """New checkpoints go where no other run's later ones are."""
        if self.folder is not None:
            checkpoint.check_fresh_folder(self.folder, self.resumed_from)

    def load(self, manifest: dict, store, device) -> None:
        """Fill `store` from the checkpoint resumed from, and restore its RNG states."""
        if self.comm is not None or manifest.get("world"):
            rng = sharded_checkpoint.load(self.resumed_from, manifest, store, self.comm)
        else:
            rng = checkpoint.load_checkpoint(self.resumed_from, manifest, store)
        self._restore_rng(rng, device)

    def _restore_rng(self, rng: dict, device) -> None:
        if "rng/torch_cpu" in rng:
            torch.set_rng_state(rng["rng/torch_cpu"])
        if "rng/cuda" in rng and device.kind == "cuda":
            torch.cuda.set_rng_state(rng["rng/cuda"], device.torch_device)

    def begin_resume(self, manifest: dict, plan, engine, device, before_unit=None) -> tuple[object, object, str]:
        """Resume from the checkpoint `check_resume` found, its unit files read while the first step trains
        (planner/checkpoint_reads.py): (the compiled resume step, the `Loading` its reads take, ""). Here, before
        the step, go the cheap parts: the manifest's checks, every unit file's size and header, the RNG states, and
        the files of units whose state lives on the device (the step uploads them at its start). Where the plan
        does not allow it (a data-parallel world's sharded checkpoint, resharded as it is read), the checkpoint is
        read here, whole, as `load` does: (None, None, why). `before_unit`: the tests' hook (Loading)."""
        from megatrain.codegen import emit, load
        from megatrain.planner.checkpoint_reads import (
            ResumePlanError,
            check_resume_pair,
            device_units,
            resume_program,
        )
        from megatrain.planner.errors import ScheduleError
        from megatrain.planner.verify import verify

        from .checkpoint_stream import Loading

        store = engine.store
        try:
            if self.comm is not None or manifest.get("world"):
                raise ResumePlanError("a data-parallel world's checkpoint is sharded and resharded as it is read")
            program = resume_program(plan.program, plan.ir)
        except ResumePlanError as e:
            self.load(manifest, store, device)
            return None, None, f"the checkpoint was read before the first step: {e}"
        problems = check_resume_pair(plan.program, program)
        if problems:
            raise ScheduleError(problems)
        verify(program, ir=plan.ir)
        ckpt = self.resumed_from
        fix, rng = checkpoint.open_streamed(ckpt, manifest, store)
        job = Loading(ckpt=ckpt, files=manifest["files"], unit_files={u["name"]: u["file"] for u in manifest["units"]},
                      fix=fix, before_unit=before_unit)
        for unit in device_units(plan.program):
            engine.read_unit(job, unit, mirror=True)  # marks the mirror stale: the step's begin() uploads it
        self._restore_rng(rng, device)
        return load(emit(program, title="resume step", summary=[], passes=[])), job, ""

    # -- saves -------------------------------------------------------------------------------------------------
    def save(self, step: int, store, device, meta: dict, model_dir: Path | None) -> Path:
        """Write checkpoint `step` of `store` (the device drained and the state checked by the caller)."""
        if self.folder is None:
            raise ValueError("no checkpoint_dir: pass checkpoint_dir=DIR (--checkpoint-dir)")
        self.take_folder()
        rng = self._rng(device)
        extra = source_files(model_dir)
        try:
            if self.comm is not None:
                self.last = sharded_checkpoint.save(self.folder, step, store, meta, self.comm, rng, keep=self.keep,
                                                    extra=extra)
            else:
                self.last = checkpoint.save_checkpoint(self.folder, step, store, meta, rng, keep=self.keep,
                                                       extra=extra)
        except OSError as e:  # a full disk, a lost mount: what the folder still holds is whole
            raise self._failed(step, e, store) from None
        return self.last

    # -- checkpoints written while training goes on (checkpoint_stream.py) ------------------------------------
    def streamed(self, plan, ir) -> tuple[object | None, str]:
        """(the compiled checkpointing step beside `plan`'s step program, or None, and a note): None without
        periodic checkpoints, and where the planner refuses one, the note saying why; else the note is the plan's warning when a checkpoint's writes
        outlast `every` steps (checkpoint_writes.py `CheckpointCost.check`), or empty."""
        if not self.every or self.folder is None:
            return None, ""
        from megatrain.codegen import emit, load
        from megatrain.planner.checkpoint_writes import (
            CheckpointPlanError,
            check_pair,
            checkpoint_cost,
            checkpoint_program,
        )
        from megatrain.planner.errors import ScheduleError
        from megatrain.planner.verify import verify

        try:
            program = checkpoint_program(plan.program)
        except CheckpointPlanError as e:
            return None, f"checkpoints are written between steps: {e}"
        problems = check_pair(plan.program, program)
        if problems:
            raise ScheduleError(problems)
        verify(program, ir=ir)
        warning = checkpoint_cost(plan).check(self.every) if self.rank == 0 else None
        return load(emit(program, title="checkpointing step", summary=[], passes=[])), warning or ""

    def job(self, step: int, index: int, store, device, meta: dict, model_dir: Path | None, abort: bool,
            after_file=None):
        """The checkpoint `step` (the state after engine step `index`) a checkpointing step is to write."""
        from .checkpoint_stream import Written

        self.take_folder()
        return Written(root=self.folder, step=step, index=index, meta=meta, rng=self._rng(device),
                       extra=source_files(model_dir), keep=self.keep, abort_on_fault=abort, after_file=after_file)

    def collect(self, jobs: list, store) -> list:
        """The jobs not yet done; a sealed one becomes `last`, a failed one raises (one line, as a save's)."""
        for job in [j for j in jobs if j.done.is_set()]:
            jobs.remove(job)
            if job.sealed is not None:
                self.last = job.sealed
            elif job.error is not None:
                if isinstance(job.error, OSError):
                    raise self._failed(job.step, job.error, store) from None
                raise job.error
        return jobs

    def _rng(self, device) -> dict:
        rng = {"rng/torch_cpu": torch.get_rng_state()}
        if device.kind == "cuda":
            rng["rng/cuda"] = torch.cuda.get_rng_state(device.torch_device)
        return rng

    def take_folder(self) -> None:
        """A run saving by hand (checkpoint_every 0) takes the folder's lock at its first save."""
        if self.lock is None and self.rank == 0:
            lock = checkpoint.FolderLock(self.folder).acquire()
            try:  # and another run may have written there since this one started
                checkpoint.check_fresh_folder(self.folder, self.resumed_from)
            except BaseException:
                lock.release()
                raise
            self.lock = lock

    def _failed(self, step: int, e: OSError, store) -> checkpoint.CheckpointError:
        """A save that failed (a full disk, a lost mount): what the folder still holds is whole."""
        kept = checkpoint.step_dirs(self.folder)
        held = (f"the last checkpoint, {kept[-1][1]}, is intact (--resume {self.folder} continues from it)"
                if kept else "no earlier checkpoint is there")
        return checkpoint.CheckpointError(
            f"cannot write checkpoint {self.folder / f'step-{step:08d}'}: {e.strerror or e}; {held}; free space "
            f"there (one checkpoint is {format_bytes(self.checkpoint_bytes(store))}) or pass another "
            "--checkpoint-dir")

    def checkpoint_bytes(self, store) -> int:
        """The bytes of the unit files of one checkpoint (masters, moments and their scales, buffers), every
        rank's shards counted: a sharded unit's part here times the ranks."""
        sharded = getattr(store, "sharded", ())  # sizes only: no mirror of a device unit is touched (resident.py)
        return sum(sum(t.nbytes for t in store.shard_views(unit).values()) * self.comm.size
                   if unit in sharded else sum(t.nbytes for t in store.state_views(unit).values())
                   for unit in store.units)

    def check_space(self, store) -> None:
        """A save writes a whole new checkpoint before it prunes an old one: the folder's filesystem must have
        room for one now, not after the steps before the first save."""
        if self.folder is None or not self.every or self.rank != 0:
            return
        where = self.folder
        while not where.exists() and where != where.parent:
            where = where.parent
        need = self.checkpoint_bytes(store)
        free = shutil.disk_usage(where).free
        if free < need:
            raise checkpoint.CheckpointError(
                f"--checkpoint-dir {self.folder}: {format_bytes(free)} free where a checkpoint takes "
                f"{format_bytes(need)}; free space there or pass a --checkpoint-dir on a larger filesystem")

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
