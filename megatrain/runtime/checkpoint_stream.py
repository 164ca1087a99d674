"""The disk stream's checkpoint ops: a checkpointing step's writes (`save_state`, `seal_checkpoint`) and a resumed
run's first step's reads (`load_state`).

Where it sits: mixed into the Engine (engine.py). The planner's checkpointing step (planner/
checkpoint_writes.py) is the step program plus, on the `disk` stream, one `save_state(u)` per unit after the
previous step's update of u and before this step's, and a `seal_checkpoint()`; the Trainer runs it at the step
after a checkpoint is due, having handed its `Written` (where, which step, the manifest's fields) to
`write_checkpoint`. Each save writes the unit's file straight from the host store's memory as the synchronous
save does (checkpoint.py `write_unit`: no copy, fsynced), into the hidden temporary folder; the seal writes the
RNG state, the extra files and the manifest and renames the folder in (checkpoint.py `finish_save`), so the
files are those of `checkpoint.save_checkpoint` at the same step, and a kill at any point leaves the previous
checkpoint whole. A failing write does not fail the device: training goes on, the checkpoint is abandoned (its
temporary removed) and the Trainer raises the error at its next look (`Written.error`).

Under `--on-nan abort` a checkpoint is sealed only if no fault was found in a step up to the one it holds: the
host optimizer runs behind the compute, so a fault of that step may be found while its files are written.

In a world (a ShardedHostStore, sharded_checkpoint.py's format) every rank writes its shard files into rank 0's
temporary folder, rank 0 the replicated units' whole files; the seal gathers every rank's file records and
verdict through the communicator's `disk` group (its own, so the gathers never interleave with the step's
collectives), and rank 0 seals only if every rank wrote all its files: whole or absent, as a synchronous one.

A resumed run's first step (planner/checkpoint_reads.py) reads the checkpoint the Trainer handed to
`read_checkpoint` (a `Loading`: its folder, file records and unit files, checked before the step) with one
`load_state(u)` per unit whose state lives on the host, each straight into the store's memory as the synchronous
load does (`read_unit`); the program's waits keep every reader of u's state behind it. Unlike a write, a failed
read fails the device: the step cannot go on without the state, and the Trainer raises the file's one-line error.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import checkpoint, sharded_checkpoint


@dataclass
class Written:
    """One checkpoint written by a checkpointing step: checkpoint `step` of the run into `root`, its manifest's
    fields `meta` (model, train, data, plan hash, ...), RNG states `rng`, extra files `extra`, the last `keep`
    kept. `index`: the engine step whose updates it holds (engine step indices count from 0). The disk stream
    fills in the rest; `done` is set when it is sealed (`sealed`) or abandoned (`error`, or a fault)."""

    root: Path
    step: int
    index: int
    meta: dict
    rng: dict | None = None
    extra: dict | None = None
    keep: int | None = None
    abort_on_fault: bool = True
    after_file: object = None  # the kill tests' hook: called with each file's name once written
    files: dict = field(default_factory=dict)
    tmp: Path | None = None
    final: Path | None = None
    sealed: Path | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Loading:
    """The checkpoint a resumed run's first step reads (planner/checkpoint_reads.py): folder `ckpt`, its
    manifest's file records `files` and unit files `unit_files` (unit -> file name), `fix` the error's advice
    (the previous checkpoint). `loaded`: the units read so far, in order; `before_unit`: the tests' hook, called
    on the disk stream with each unit's name before its file is read."""

    ckpt: Path
    files: dict
    unit_files: dict
    fix: str
    loaded: list = field(default_factory=list)
    before_unit: object = None


class CheckpointStream:
    """The Engine's disk-stream ops. `write_checkpoint(job)` names the checkpoint the next checkpointing step
    writes; `take_faults()` drains the store's faults where a seal can still see them."""

    _written: Written | None = None
    _fault_lock = threading.Lock()
    faults_seen: tuple = ()  # faults the Trainer took, (engine step index, what)

    def write_checkpoint(self, job: Written) -> None:
        """The checkpoint the next save_state/seal_checkpoint instructions write (bound as they are issued)."""
        self._written = job

    def take_faults(self) -> list[tuple[int, str]]:
        """The store's faults since the last call (HostStore.take_faults), remembered for the seals to come."""
        with self._fault_lock:
            faults = self.store.take_faults()
            self.faults_seen = (*self.faults_seen, *faults)
        return faults

    def save_state(self, i: int, unit: str) -> None:
        job = self._job("save_state")
        self._submit("disk", i, f"save_state({unit})", lambda: self._save_unit(job, unit))

    def seal_checkpoint(self, i: int) -> None:
        job = self._job("seal_checkpoint")
        self._written = None
        self._submit("disk", i, "seal_checkpoint()", lambda: self._seal(job))

    # -- a resume's reads -----------------------------------------------------------------------------------------
    _loading: Loading | None = None

    def read_checkpoint(self, job: Loading | None) -> None:
        """The checkpoint the next load_state instructions read (bound as they are issued; None: none)."""
        self._loading = job

    def load_state(self, i: int, unit: str) -> None:
        job = self._loading
        if job is None:
            raise ValueError("load_state: no checkpoint to read; the Trainer names it (Engine.read_checkpoint) "
                             "before it runs a resume step")
        self._submit("disk", i, f"load_state({unit})", lambda: self.read_unit(job, unit))

    def read_unit(self, job: Loading, unit: str, mirror: bool = False) -> None:
        """`unit`'s file into the host store's memory, as the synchronous load reads it (checkpoint.py
        `read_unit`: straight into the views, sha256 checked); the views mark the unit's masters changed (its
        cast copy stale, its weight bound unknown: store.py `state_tensors`). On the disk stream `mirror` is
        False: a unit streamed here lives on the host, and its reader waits for the load's record. A unit whose
        state lives on the device is read with `mirror` before the first step, which then uploads it. An error
        (a flipped byte, an I/O error) is raised: on the disk stream it fails the device, so no stream waits
        for a load that never comes, and the Trainer raises it."""
        if job.before_unit is not None:
            job.before_unit(unit)
        targets = self.store.state_tensors(unit, mirror=mirror)
        checkpoint.read_unit(job.ckpt, job.unit_files[unit], job.files, targets, job.fix)
        job.loaded.append(unit)

    # -- on the disk stream --------------------------------------------------------------------------------------
    def _job(self, op: str) -> Written:
        if self._written is None:
            raise ValueError(f"{op}: no checkpoint to write; the Trainer names it (Engine.write_checkpoint) before "
                             "it runs a checkpointing step")
        return self._written

    def _save_unit(self, job: Written, unit: str) -> None:
        if job.tmp is None and self.comm is not None:  # every rank takes part, whatever happened before
            self._begin_world(job)
        if job.error is not None:
            return
        try:
            if job.tmp is None:
                job.root, job.final, job.tmp = checkpoint.begin_save(job.root, job.step)
            if unit in getattr(self, "dstate", {}):  # its state lives on the device: into the host mirror first
                self._pull(unit)
            name, state = self._unit_file(unit)
            if name is None:
                return
            job.files[name] = checkpoint.write_unit(job.tmp, name, state, unit)
            if job.after_file is not None:
                job.after_file(name)
        except Exception as e:  # noqa: BLE001  (the Trainer raises it; training goes on meanwhile)
            job.error = e

    def _pull(self, unit: str) -> None:
        """A device unit's state into its host mirror (resident.py), finished before the write reads it. The
        program's wait put the previous step's device_step behind; on cuda the copies run on a stream of this
        thread's own, ordered after the compute stream's work issued so far (the previous step's device_step
        among it; the compute stream issues nothing that writes the unit's state until this save is done)."""
        if self.device.kind != "cuda":
            self.pull_unit_state(unit)
            return
        import torch

        if getattr(self, "_pull_stream", None) is None:
            self._pull_stream = torch.cuda.Stream(device=self.device.torch_device)
        self._pull_stream.wait_stream(self.device.cuda_stream("compute"))
        with torch.cuda.stream(self._pull_stream):
            self.pull_unit_state(unit)
        self._pull_stream.synchronize()

    def _unit_file(self, unit: str):
        """(file name, state views) this rank writes for `unit`; (None, None) where another rank writes it."""
        store = self.store  # views with no side effect and no device sync from this thread (the pull came first)
        if self.comm is None:
            return f"{unit}.safetensors", store.state_views(unit)
        if unit in store.sharded:
            return sharded_checkpoint.SHARD_FILE.format(unit=unit, rank=self.comm.rank), store.shard_views(unit)
        if self.comm.rank == 0:
            return f"{unit}.safetensors", store.state_views(unit)
        return None, None

    def _begin_world(self, job: Written) -> None:
        """Rank 0 makes the temporary folder (named by its pid) that every rank writes into."""
        comm = self.comm
        try:
            owner = comm.gather_objects(os.getpid(), group="disk", what="the checkpoint's owner")[0]
            made = None
            if comm.rank == 0:
                try:
                    job.root, job.final, job.tmp = checkpoint.begin_save(job.root, job.step, owner)
                    made = str(job.tmp)
                except Exception as e:  # noqa: BLE001
                    job.error = e
            made = comm.gather_objects(made, group="disk", what="the checkpoint folder's creation")[0]
            if comm.rank != 0:
                job.final, job.tmp = job.root / f"step-{job.step:08d}", job.root / f".step-{job.step:08d}.tmp-{owner}"
                if made is not None and not job.tmp.is_dir():
                    raise checkpoint.CheckpointError(
                        f"{job.tmp}: rank {comm.rank} does not see the folder rank 0 made: --checkpoint-dir must be on "
                        "a filesystem every node shares (NFS, Lustre, ...)")
            if made is None and job.error is None:
                job.error = checkpoint.CheckpointError(f"rank 0 could not make {job.root}'s temporary folder")
        except Exception as e:  # noqa: BLE001
            job.error = job.error or e

    def _seal(self, job: Written) -> None:
        if self.comm is not None:
            return self._seal_world(job)
        try:
            if job.error is None and not self._faulty(job):
                layout = [checkpoint._unit_layout(name, st) for name, st in self.store.units.items()]
                missing = [u["file"] for u in layout if u["file"] not in job.files]
                if missing:
                    raise ValueError(f"the checkpointing step wrote no {missing[0]}: its program misses a save_state")
                files = {u["file"]: job.files[u["file"]] for u in layout}  # the synchronous save's order
                body = {"step": job.step, **job.meta, "host_policy": self.store.policy.name, "units": layout}
                checkpoint.finish_save(job.root, job.final, job.tmp, body, files, job.rng, job.extra, job.keep)
                job.sealed = job.final
        except Exception as e:  # noqa: BLE001
            job.error = e
        finally:
            if job.tmp is not None and job.sealed is None:
                shutil.rmtree(job.tmp, ignore_errors=True)
            job.done.set()

    def _seal_world(self, job: Written) -> None:
        comm, store = self.comm, self.store
        try:
            ok = job.error is None and not self._faulty(job)
            every = comm.gather_objects((job.files, ok), group="disk", what="the checkpoint's file records")
            if comm.rank == 0 and all(fine for _, fine in every):
                ir, files = store.full_ir, {}
                for theirs, _ in every:  # the synchronous save's order: rank by rank, units in depth order
                    order = {name: k for k, u in enumerate(ir.units) for name in
                             (f"{u.name}.safetensors", *(sharded_checkpoint.SHARD_FILE.format(unit=u.name, rank=r)
                                                         for r in range(comm.size)))}
                    files.update(sorted(theirs.items(), key=lambda kv: order[kv[0]]))
                body = sharded_checkpoint.manifest_body(job.step, job.meta, ir, store, comm)
                checkpoint.finish_save(job.root, job.final, job.tmp, body, files, job.rng, job.extra, job.keep)
                job.sealed = job.final
            sealed = comm.gather_objects(job.sealed is not None, group="disk", what="the checkpoint's seal")[0]
            job.sealed = job.final if sealed else None
            if not sealed and job.error is None and ok:
                job.error = checkpoint.CheckpointError(f"another rank could not write its part of {job.final}")
        except Exception as e:  # noqa: BLE001
            job.error = job.error or e
        finally:
            if comm.rank == 0 and job.tmp is not None and job.sealed is None:
                shutil.rmtree(job.tmp, ignore_errors=True)
            job.done.set()

    def _faulty(self, job: Written) -> bool:
        """Under abort: a fault in a step up to the checkpoint's (the state mixes updated and skipped units)."""
        if not job.abort_on_fault:
            return False
        with self._fault_lock:
            found = [*self.store.faults, *self.faults_seen]
        return any(index <= job.index for index, _ in found)
