"""Trainer: the whole pipeline for one training run, from a model name to trained weights and metrics.

Where it sits: the top of the runtime. trace (ir/) -> plan (planner/) -> emit + load (codegen/) -> Engine on
a device (sim or cuda) with the host store. `megatrain train` is a thin CLI over it; `make demo` runs it.
Try it: `megatrain train --model tiny --device sim --gpu-mem 2MiB --steps 20 --seq-len 128`.

Checkpoints and resume (checkpoint.py, docs/CHECKPOINTS.md): every `checkpoint_every` steps, after the
device drains, the store is written to `checkpoint_dir`; `resume=DIR` loads one and continues bit for bit:
the data order is `Batcher.batch(step)`, the learning rate `lr_at(train, step)`, both functions of the step.

Numerical faults (`on_nan`): a NaN or inf in a step's loss or gradients is never applied (HostStore
`check_finite`). "abort" raises NumericalFault (a ValueError: one line from the CLI) and writes no checkpoint
from that state; "skip" logs the step and goes on. A skip must be all or nothing for the step, so with
"skip" the program is planned with the clip_grads barrier (the host optimizer starts once every gradient has
landed, in forward order) even without clipping; see docs/CHECKPOINTS.md for the cost.

Metrics: one JSON record per logged step (loss, lr, step time, tokens/s, device peaks, grad norm,
validation loss). `step_time_s` covers the step until its state is final, its host optimizer included: the
wall time from the step's start (or, when it overlapped the previous step's host optimizer, from that step's
final state) to its own last host-stream op, so the figures of back-to-back steps add up to the run's wall
time and tokens/s is steady-state throughput; `compute_time_s` is the part until the loss was known (the host
optimizer may still run then). A record is written once its step is final, at the latest right after the next
step's compute. Each record also carries the time to the first step: the host store's creation as measured
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

Test hook: MEGATRAIN_TEST_PAUSE_AT=optimizer:K pauses the host optimizer after the first unit of step K
(1-based) has stepped, and =checkpoint:K pauses the save of checkpoint K after its first file; either prints
`megatrain-test: paused at ...` to stderr and sleeps, so tests/runtime/test_resume_kill.py can SIGKILL there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from megatrain.codegen import emit, load
from megatrain.files import append_open
from megatrain.ir.trace import trace
from megatrain.models import load_model_config
from megatrain.planner import Plan, TrainSpec, hardware_preset, plan
from megatrain.planner.bytesize import format_bytes, parse_bytes
from megatrain.planner.hardware import hardware_for_device
from megatrain.planner.host_policy import read_request as read_policy_request

from . import checkpoint
from .cpus import resolve as resolve_cpus
from .data import Batcher, DataError, TokenFile, check_sizes, eval_batches
from .device import Device, make_device
from .engine import Engine, evaluate
from .examples import ExampleBatcher, example_eval_batches
from .hf_load import SOURCE_FILES, check_weights, load_weights
from .optim import lr_at
from .store import HostStore

ON_NAN = ("abort", "skip")
PAUSE_ENV = "MEGATRAIN_TEST_PAUSE_AT"
HOST_MEM_ENV = "MEGATRAIN_HOST_MEM"  # the host memory to plan and check against, for a machine that grows it


class NumericalFault(ValueError):
    """A NaN or inf in a step's loss or gradients under on_nan="abort"."""


class HostMemoryError(ValueError):
    """The plan needs more host memory than the machine has available."""


class Preempted(Exception):
    """The run was stopped by a signal after the step in flight (and, when checkpointing is configured, a
    checkpoint of that step was written). `exit_code` is 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        kept = (f"checkpoint {checkpoint} written; resume with --resume {checkpoint.parent}" if checkpoint else
                "no checkpointing was configured, so nothing was saved (--checkpoint-every N keeps one)")
        super().__init__(f"stopped by {name} after step {step}: {kept}")
        self.signum, self.step, self.checkpoint, self.exit_code = signum, step, checkpoint, 128 + signum


@contextlib.contextmanager
def _signals(enabled: bool):
    """A list that a first SIGTERM or SIGINT fills with its number; a second one ends the process with that
    signal at once. Handlers are restored afterwards. Only in the main thread (Python's rule for signals)."""
    got: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, frame):
        if got:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        got.append(signum)
        print(f"{signal.Signals(signum).name}: stopping after the step in flight (again to stop at once)",
              file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def available_host_bytes() -> int | None:
    """Memory this process can still get: MemAvailable, capped by a cgroup v2 limit less the cgroup's anonymous
    memory (its page cache is reclaimable, as in MemAvailable); None where unknown (not Linux). HOST_MEM_ENV,
    when set, is the answer instead: a machine whose memory grows as it is used (the lent GPU machines start
    far below their 128 GiB) shows a MemAvailable at start that is no guide (benchmarks/gpu/run.sh sets it)."""
    given = os.environ.get(HOST_MEM_ENV, "").strip()
    if given:
        try:
            value = parse_bytes(given)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"{HOST_MEM_ENV}={given!r}: expected a positive size such as 120GiB")
        return value
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines())
            left = int(limit) - int(stat["anon"])
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError, KeyError):
        pass
    return avail


class Trainer:
    """Plans, compiles and runs streamed training; one record of metrics per logged step."""

    def __init__(self, model, train: TrainSpec, gpu_budget_bytes: int, *, hardware="auto", device: str = "sim",
                 data: str | Path | None = None, val_data: str | Path | None = None,
                 metrics_path: str | Path | None = None, delays: tuple[float, float] | None = None,
                 loss_chunk: int = 1024, the_plan: Plan | None = None, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, keep_checkpoints: int | None = 3, resume: str | Path | None = None,
                 on_nan: str = "abort", settings: dict | None = None, pack: bool | None = None,
                 allow_data_change: bool = False, host_policy: str = "auto", comm=None, profile: str = "off",
                 sim_threads: int | None = None, compile_units: bool = False):
        if on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {', '.join(ON_NAN)}, got {on_nan!r}")
        if not isinstance(train, TrainSpec):
            raise ValueError(f"train must be a TrainSpec, e.g. TrainSpec(micro_batch=1, seq_len=4096), got "
                             f"{type(train).__name__}")
        gpu_budget_bytes = parse_bytes(gpu_budget_bytes)  # "6MiB" as plan() takes it, or bytes
        for name, value in (("data", data), ("val_data", val_data), ("checkpoint_dir", checkpoint_dir),
                            ("metrics_path", metrics_path), ("resume", resume)):
            if value is not None and not isinstance(value, str | Path):
                raise ValueError(f"{name} must be a path (str or Path), got {type(value).__name__}")
        if checkpoint_dir is not None and Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
            raise ValueError(f"checkpoint_dir {checkpoint_dir} is a file, not a folder: pass a folder for the "
                             "step-NNNNNNNN checkpoints")
        for name, value in (("checkpoint_every", checkpoint_every), ("keep_checkpoints", keep_checkpoints)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if checkpoint_every < 0 or (checkpoint_every and checkpoint_dir is None):
            raise ValueError("checkpoint_every must be >= 0 and needs a checkpoint_dir")
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (or None: keep all), got {keep_checkpoints}")
        if not isinstance(host_policy, str):
            raise ValueError(f"host_policy must be 'auto' or a policy's name, got {type(host_policy).__name__}")
        host_policy = read_policy_request(host_policy)
        self._closed = False
        self.comm, self.rank = comm, comm.rank if comm is not None else 0
        self.config = load_model_config(model)
        # A Hugging Face model folder: training starts from its weights (fresh optimizer state), and its
        # config and tokenizer files travel in every checkpoint so export can write a complete folder.
        self.model_dir = Path(model) if isinstance(model, str | Path) and Path(model).is_dir() else None
        self.settings = settings  # the effective run settings (CLI flags and --config), saved in manifests
        self.allow_data_change = allow_data_change  # resume on data whose bytes changed (its fingerprint)
        self.train = train
        self.on_nan = on_nan
        # "auto": the profile of the device that runs it (the cpu preset for sim, the GPU's preset on cuda)
        index = comm.local_rank if comm is not None and device == "cuda" else 0  # the GPU make_device takes
        self.hardware = (hardware_for_device(device, index) if hardware == "auto" else
                         hardware_preset(hardware) if isinstance(hardware, str) else hardware)
        if profile not in ("off", "auto"):
            raise ValueError(f"profile must be 'auto' (plan with a cached probe of this machine when one exists) "
                             f"or 'off', got {profile!r}")
        self.profile = profile
        self.compile_units = compile_units  # units through torch.compile (compiled.py): round-off, not bits
        self.profile_note = ""  # how the plan's op costs were obtained (the CLI prints it)
        # Cheap checks first: a bad data file or checkpoint is reported before anything big is allocated.
        self.data = self._open_data(data) if data else None
        self.val_data = self._open_data(val_data) if val_data else None
        if self.val_data is not None:  # a file too short for one validation batch is refused now, not hours in
            if self.val_data.examples is None:
                check_sizes(self.val_data, micro_batch=train.micro_batch, seq_len=train.seq_len, n_batches=1)
            else:
                ExampleBatcher(self.val_data, train.micro_batch, train.seq_len, 1, seed=0, shuffle=False)
        self.pack = pack is not False and self.data is not None and self.data.examples is not None
        if pack and not self.pack:
            raise DataError(f"{data}: packing needs instruction data (examples); a token stream is cut into "
                            "windows: drop --pack, or prepare chat or alpaca JSONL")
        if self.data is None:
            self.batcher = None
        elif self.data.examples is not None:
            self.batcher = ExampleBatcher(self.data, train.micro_batch, train.seq_len, train.grad_accum, train.seed,
                                          pack=self.pack)
        else:
            self.batcher = Batcher(self.data, train.micro_batch, train.seq_len, train.grad_accum, train.seed)
        self.resumed_from: Path | None = None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self.metrics_path = Path(metrics_path) if metrics_path and self.rank == 0 else None
        self.step = 0
        self.events: list[dict] = []  # skipped steps under on_nan="skip"
        self.plan_changed = False  # resumed under a different program (fine: the math does not depend on it)
        self._sink = None  # the open metrics file during run()
        self._open: list[dict] = []  # records of steps whose state is not final yet (run())
        self._last_final: float | None = None  # when the last completed record's step was final
        self._pause = _pause_point()
        self.device: Device | None = None
        # one run writes into a checkpoint folder at a time: its lock is held until close()
        self._lock = (checkpoint.FolderLock(checkpoint_dir).acquire()
                      if checkpoint_dir and checkpoint_every and self.rank == 0 else None)
        try:
            manifest = self._check_resume(resume) if resume is not None else None
            if manifest is not None:  # auto resumes under the checkpoint's host policy; another one is refused
                if host_policy != "auto":
                    checkpoint.check_policy(manifest, host_policy, self.resumed_from)
                host_policy = checkpoint.manifest_policy(manifest, self.resumed_from)
            self.host_policy = host_policy
            self.last_checkpoint: Path | None = self.resumed_from
            if self.checkpoint_dir is not None:
                checkpoint.check_fresh_folder(self.checkpoint_dir, self.resumed_from)
            self.weights = check_weights(self.model_dir, self.config) if self.model_dir and manifest is None else None
            kw = {"delays": delays} if delays and device == "sim" else {}
            if comm is not None and device == "cuda":
                kw["index"] = comm.local_rank
            if sim_threads is not None and (device == "sim" or device == "auto" and not torch.cuda.is_available()):
                kw["cpu"] = resolve_cpus("sim", sim_threads=sim_threads)
            self.device = make_device(device, budget_bytes=gpu_budget_bytes, **kw)
            if compile_units:
                from .compiled import check_toolchain

                if self.config.moe is not None:
                    raise ValueError(f"--compile-units compiles dense models' blocks; {self.config.name} routes "
                                     "tokens to experts (MoE), whose blocks run eagerly: drop --compile-units")

                check_toolchain(self.device.kind)
            self._build(the_plan, gpu_budget_bytes, loss_chunk, resume is None and self.weights is None)
            if self.weights is not None:
                load_weights(self.weights, self.store)
            if manifest is not None:
                self._resume(manifest)
            else:  # NOTE: training draws no random numbers today; if it ever does, a run stays a function of
                torch.manual_seed(train.seed)  # (seed, step): seeded here, restored from a checkpoint on resume
        except BaseException:
            if self.device is not None:
                self.device.close()
            self._release()
            raise

    def _open_data(self, path) -> TokenFile:
        """A token file checked against the model: its ids fit the vocabulary, and a model folder with its
        own tokenizer trains only on data made with that tokenizer."""
        tf = TokenFile.open(path, vocab_size=self.config.vocab_size)
        made_for = tf.meta.get("vocab_size")
        if isinstance(made_for, int) and made_for > self.config.vocab_size:
            raise DataError(f"{path}: was prepared with a tokenizer of {made_for:,} ids but the model's vocab_size is "
                            f"{self.config.vocab_size:,}; prepare the data with the model's tokenizer")
        mine = self.model_dir / "tokenizer.json" if self.model_dir else None
        if mine is not None and mine.is_file():
            want = hashlib.sha256(mine.read_bytes()).hexdigest()
            if tf.meta.get("tokenizer_sha256") != want:
                made = tf.meta.get("tokenizer", "unknown")
                raise DataError(f"{path}: was made with another tokenizer ({made}) than the model's {mine}; "
                                f"prepare it with `megatrain prepare ... --tokenizer {self.model_dir}`")
        return tf

    def _build(self, the_plan: Plan | None, budget: int, loss_chunk: int, init: bool) -> None:
        train = self.train
        if the_plan is None:
            ir = trace(self.config, train.micro_batch, train.seq_len, train.dtype, loss_chunk=loss_chunk,
                       target="cpu" if self.device.kind == "sim" else "cuda", packed=self.pack)
            if self.compile_units:  # a compiled unit's fused attention is not replayable (models/replay.py)
                ir = ir.without_replay()
            self.hardware = self._profiled(ir, loss_chunk)
            barrier = self.on_nan == "skip" and train.clip_norm is None
            # NOTE: clip_norm here only shapes the program (a clip_grads barrier before the host optimizer);
            # the store clips with self.train, i.e. not at all, and the plan records self.train.
            the_plan = plan(ir, self.hardware, train.replace(clip_norm=1.0) if barrier else train, budget,
                            host_policy=self.host_policy, world=self._world())
            the_plan = the_plan.replace(train=train) if barrier else the_plan
        if self.on_nan == "skip" and not any(i.op == "clip_grads" for i in the_plan.program.instrs):
            raise ValueError("on_nan='skip' needs a program with a clip_grads barrier (a step is skipped whole); "
                             "let the Trainer plan, or plan with clip_norm set")
        self.plan = the_plan
        self.source = emit(self.plan)
        self.program = load(self.source)
        self._check_host_memory()
        # the process is held to the budget the plan was made for, less the reserve the plan keeps for what
        # the allocator never sees (CUDA context, library workspaces)
        self.device.limit_allocator(self.plan.gpu_budget_bytes - self.plan.hardware.reserved_bytes)
        created = time.perf_counter()  # the time to the first step: the store's creation (runtime/host_init.py)
        if self.comm is None:
            self.store = HostStore(self.plan.ir, train, seed=train.seed, policy=self.plan.host_policy,
                                   program=self.plan.program, device=self.device.kind, init=init)
        else:  # every rank checked its host memory and planned the same step before anyone allocates
            hashes = self.comm.gather_objects(self.plan_sha256, what="the ranks' plans")
            if len(set(hashes)) > 1:
                other = next(r for r, h in enumerate(hashes) if h != hashes[0])
                raise ValueError(f"rank {other} planned another step program than rank 0: give every rank the same "
                                 "flags, model, hardware profile and megatrain version")
            self._check_same_data()
            from .sharded_store import ShardedHostStore

            created = time.perf_counter()
            self.store = ShardedHostStore(self.plan.ir, train, seed=train.seed, policy=self.plan.host_policy,
                                          program=self.plan.program, comm=self.comm, device=self.device.kind,
                                          init=init)
        self.time_to_first_step_s = time.perf_counter() - created
        self.store.check_finite = True
        self.store.stop_on_fault = self.on_nan == "abort"
        if self.checkpoint_dir is not None and self.checkpoint_every and self.rank == 0:
            self._check_checkpoint_space()
        self.engine = Engine(self.plan.ir, self.plan.program, self.device, self.store, loss_chunk=loss_chunk,
                             comm=self.comm, compile_units=self.compile_units)
        if self._pause and self._pause[0] == "optimizer":
            self._pause_optimizer(self._pause[1])

    def _check_same_data(self) -> None:
        """Every rank draws its part of each global batch from the same data order: the ranks' data (its size,
        sidecar hash and fingerprint, with the order's settings) must agree before any step, not only at a
        resume, where the checkpoint records rank 0's alone."""
        mine = None if self.batcher is None else {k: v for k, v in self.batcher.state(0).items()
                                                  if k not in ("data", "step")}
        every = self.comm.gather_objects(mine, what="the ranks' data")
        other = next((r for r, d in enumerate(every) if d != every[0]), None)
        if other is not None:
            theirs, first = every[other] or {}, every[0] or {}
            diff = [k for k in sorted({*theirs, *first}) if theirs.get(k) != first.get(k)]
            raise DataError(f"rank {other} reads other data than rank 0 ({', '.join(diff) or '--data given to one'} "
                            "differ): every rank must be given the same --data file (each trains on its own part of "
                            "every batch)")

    def _profiled(self, ir, loss_chunk: int):
        """The hardware to plan with: with profile="auto", this machine's cached probe of the model's units
        (runtime/unit_probe.py) when one exists, its sizes those of the profile given; else the profile given.
        Only the plan's speed depends on it: any schedule trains to the same bits (a long sequence's tile size,
        which the chunks pass also picks by speed, to fp32 round-off). In a world every rank plans with the
        profile given: each node has a cache of its own, and the ranks' programs must agree."""
        if self.profile != "auto":
            return self.hardware
        if self.comm is not None:
            self.profile_note = (f"planned with the {self.hardware.name} profile: in a world the ranks plan alike, "
                                 "without a node's cached probe (pass a probed profile as --hardware FILE)")
            return self.hardware
        from .unit_probe import cached_hardware, device_threads

        cached = cached_hardware(ir, self.device.kind, device_threads(self.device), loss_chunk,
                                 compiled=self.compile_units)
        if cached is None:
            self.profile_note = (f"planned with the {self.hardware.name} profile: no probe of {ir.model} at this "
                                 f"micro-batch, sequence length and dtype is cached for this machine; `megatrain "
                                 f"probe --model ...` with the same settings measures one")
            return self.hardware
        from megatrain.planner.profile import cache_path

        self.profile_note = (f"planned with the probe of this machine measured {cached.units.measured_at}, cached "
                             f"as {cache_path(cached.units.key)} (name a preset with --hardware to plan without it)")
        # NOTE: a probe measures speeds; the sizes stay those of the hardware given (its --host-mem, a GPU's memory)
        return cached.replace(host_memory_bytes=self.hardware.host_memory_bytes,
                              gpu_memory_bytes=self.hardware.gpu_memory_bytes)

    # -- host memory, checkpoints, resume ----------------------------------------------------------------------
    def _world(self):
        from megatrain.planner.world import World

        return World(nproc=self.comm.size, nnodes=self.comm.nnodes) if self.comm is not None else None

    def _check_host_memory(self) -> None:
        """Refuse to allocate a store the machine cannot hold (on the sim device, the device's buffers and
        workspace are host memory too); in a world, what every rank of this node will hold."""
        local = self.comm.local_size if self.comm is not None else 1
        node = self.rank // local
        shares = self.plan.host_bytes_per_rank or (self.plan.host_bytes,)
        need = sum(shares[node * local : (node + 1) * local]) + local * (
            self.plan.peak_gpu_bytes if self.device.kind == "sim" else 0)
        avail = available_host_bytes()
        if avail is not None and need > avail:
            raise HostMemoryError(
                f"the plan needs {format_bytes(need)} ({need:,} bytes) of host memory for weights, gradients and "
                f"AdamW states but only {format_bytes(avail)} ({avail:,} bytes) is available; free memory, use a "
                "machine with more RAM, or train a smaller model")

    @property
    def plan_sha256(self) -> str:
        return hashlib.sha256(self.plan.program.to_json().encode()).hexdigest()

    def _check_resume(self, resume: str | Path) -> dict:
        ckpt = checkpoint.find_checkpoint(resume)
        manifest = checkpoint.read_manifest(ckpt)
        checkpoint.check_model(manifest, self.config, ckpt)
        checkpoint.check_train(manifest, self.train, ckpt)
        if self.batcher is not None and manifest.get("data"):
            try:
                self.batcher.check_state(manifest["data"], self.allow_data_change)
            except ValueError as e:
                raise checkpoint.CheckpointError(f"{ckpt / checkpoint.MANIFEST}: {e}") from None
        self.resumed_from = ckpt
        return manifest

    def _resume(self, manifest: dict) -> None:
        if self.comm is not None or manifest.get("world"):
            from .sharded_checkpoint import load

            rng = load(self.resumed_from, manifest, self.store, self.comm)
        else:
            rng = checkpoint.load_checkpoint(self.resumed_from, manifest, self.store)
        self.step = manifest["step"]
        self.engine.step_index = self.step  # the device treats the previous step's events as done
        if "rng/torch_cpu" in rng:
            torch.set_rng_state(rng["rng/torch_cpu"])
        if "rng/cuda" in rng and self.device.kind == "cuda":
            torch.cuda.set_rng_state(rng["rng/cuda"], self.device.torch_device)
        self.plan_changed = manifest.get("plan_sha256") != self.plan_sha256

    def save_checkpoint(self) -> Path:
        """Drain the device, refuse a faulty state, write checkpoint `self.step`; returns its folder."""
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint_dir: pass checkpoint_dir=DIR (--checkpoint-dir)")
        if self._lock is None and self.rank == 0:  # a run saving by hand (checkpoint_every 0) takes the folder now
            lock = checkpoint.FolderLock(self.checkpoint_dir).acquire()
            try:  # and another run may have written there since this one started
                checkpoint.check_fresh_folder(self.checkpoint_dir, self.resumed_from)
            except BaseException:
                lock.release()
                raise
            self._lock = lock
        self.device.synchronize()
        self._handle_faults()
        rng = {"rng/torch_cpu": torch.get_rng_state()}
        if self.device.kind == "cuda":
            rng["rng/cuda"] = torch.cuda.get_rng_state(self.device.torch_device)
        meta = {"model": self.config.model_dump(), "train": self.train.model_dump(mode="json"),
                "data": self.batcher.state(self.step) if self.batcher else None,
                "plan_sha256": self.plan_sha256,
                "run": {"device": self.device.kind, "gpu_budget_bytes": self.plan.gpu_budget_bytes,
                        "hardware": self.hardware.name, "on_nan": self.on_nan},
                "settings": self.settings,
                "source": {"hf_dir": str(self.model_dir.resolve())} if self.model_dir else None}
        hook = None
        if self._pause == ("checkpoint", self.step):
            def hook(name: str) -> None:
                _pause_here(f"checkpoint:{self.step} after {name}")
        extra = {f"hf/{name}": self.model_dir / name for name in SOURCE_FILES
                 if self.model_dir and (self.model_dir / name).is_file()}
        try:
            if self.comm is not None:
                from .sharded_checkpoint import save

                self.last_checkpoint = save(self.checkpoint_dir, self.step, self.store, meta, self.comm, rng,
                                            keep=self.keep_checkpoints, after_file=hook, extra=extra)
            else:
                self.last_checkpoint = checkpoint.save_checkpoint(self.checkpoint_dir, self.step, self.store, meta,
                                                                  rng, keep=self.keep_checkpoints, after_file=hook,
                                                                  extra=extra)
        except OSError as e:  # a full disk, a lost mount: what the folder still holds is whole
            kept = checkpoint.step_dirs(self.checkpoint_dir)
            held = (f"the last checkpoint, {kept[-1][1]}, is intact (--resume {self.checkpoint_dir} continues "
                    "from it)" if kept else "no earlier checkpoint is there")
            raise checkpoint.CheckpointError(
                f"cannot write checkpoint {self.checkpoint_dir / f'step-{self.step:08d}'}: {e.strerror or e}; "
                f"{held}; free space there (one checkpoint is {format_bytes(self.checkpoint_bytes())}) or pass "
                "another --checkpoint-dir") from None
        return self.last_checkpoint

    def checkpoint_bytes(self) -> int:
        """The bytes of the unit files of one checkpoint (masters, moments and their scales, buffers), every
        rank's shards counted: a sharded unit's part here times the ranks."""
        sharded = getattr(self.store, "sharded", ())
        return sum(sum(t.nbytes for t in self.store.shard_state(unit).values()) * self.comm.size if unit in sharded
                   else sum(t.nbytes for t in self.store.state_tensors(unit).values()) for unit in self.store.units)

    def _check_checkpoint_space(self) -> None:
        """A save writes a whole new checkpoint before it prunes an old one: the folder's filesystem must have
        room for one now, not after the steps before the first save."""
        where = self.checkpoint_dir
        while not where.exists() and where != where.parent:
            where = where.parent
        need = self.checkpoint_bytes()
        free = shutil.disk_usage(where).free
        if free < need:
            raise checkpoint.CheckpointError(
                f"--checkpoint-dir {self.checkpoint_dir}: {format_bytes(free)} free where a checkpoint takes "
                f"{format_bytes(need)}; free space there or pass a --checkpoint-dir on a larger filesystem")

    # -- numerical faults --------------------------------------------------------------------------------------
    def _handle_faults(self, loss: float | None = None) -> None:
        """Abort on a fault, or log the skipped steps. Faults of a step may surface a step later (the host
        optimizer runs behind the compute), and always by the next synchronize."""
        faults = [(step + 1, what) for step, what in self.store.take_faults()]
        if self.on_nan == "abort":
            if loss is not None and not math.isfinite(loss):
                faults.insert(0, (self.step, f"the loss is {loss}"))
            if faults:
                step, what = min(faults, key=lambda f: f[0])  # the first fault; the loss before its gradients
                kept = (f"the last checkpoint, {self.last_checkpoint}, is intact" if self.last_checkpoint
                        else "no checkpoint had been written (--checkpoint-every N keeps one)")
                raise NumericalFault(
                    f"step {step}: {what}; training stopped (--on-nan abort) without writing a checkpoint from "
                    f"this state, and {kept}; lower --lr, set --clip-norm, check the data, or pass --on-nan "
                    "skip to skip such steps")
            return
        for step, what in faults:
            event = {"step": step, "event": "skipped", "reason": f"{what}: no update applied (--on-nan skip)"}
            self.events.append(event)
            self._write_record(event)
            print(f"step {step}: {event['reason']}", file=sys.stderr, flush=True)

    def _write_record(self, rec: dict) -> None:
        if self._sink:
            self._sink.write(json.dumps(rec) + "\n")
            self._sink.flush()

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
        loss = self.program.step(self.engine, batch, lr)
        self.step += 1
        return loss

    def validation_loss(self, n_batches: int = 4) -> float | None:
        if self.val_data is None:
            return None
        t = self.train
        if self.val_data.examples is not None:
            return evaluate(self.engine, example_eval_batches(self.val_data, t.micro_batch, t.seq_len, n_batches,
                                                              pack=self.pack))
        return evaluate(self.engine, eval_batches(self.val_data, t.micro_batch, t.seq_len, n_batches))

    def run(self, steps: int, log_every: int = 1, eval_every: int = 0, progress: bool = True,
            handle_signals: bool = True) -> list[dict]:
        """Train `steps` optimizer steps from the current step; returns the logged records. Checkpoints every
        `checkpoint_every` steps and after the last one. With `handle_signals` (in the main thread), SIGTERM
        and SIGINT stop the run after the step in flight: a checkpoint is written when checkpointing is
        configured and `Preempted` is raised; a second signal ends the process at once (the atomic writes leave
        nothing half-written under a final name)."""
        if self._closed:
            raise ValueError("this Trainer is closed: build a new one (resume=DIR continues from a checkpoint)")
        if self.batcher is None:
            raise ValueError("no training data: pass data=PATH (see `megatrain prepare`)")
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

        records: list[dict] = []
        cols = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"),
                TimeRemainingColumn()]
        last = self.step + steps
        logs = append_open(self.metrics_path, "--metrics") if self.metrics_path else contextlib.nullcontext()
        progress = progress and self.rank == 0
        with logs as sink, _signals(handle_signals) as stop, Progress(*cols, disable=not progress) as bar:
            self._sink = sink
            task = bar.add_task("train", total=last, completed=self.step, info="")

            def finish(block: bool) -> None:
                # NOTE: a step's record is complete once its state is final (its host optimizer done): right
                # after the next step's compute at the latest (every load of that step waits for an update of
                # this one), or at a synchronize; records stay in step order
                while self._open and self._final(self._open[0], block):
                    rec = self._open.pop(0)
                    if rec["step"] % log_every == 0 or "val_loss" in rec:
                        records.append(rec)
                        self._write_record(rec)
                    bar.update(task, info=self._progress_info(rec))

            try:
                for _ in range(steps):
                    self._open.append(self._logged_step(eval_every))
                    finish(block=len(self._open) > 1)
                    saved = self.checkpoint_every and (self.step % self.checkpoint_every == 0 or self.step == last)
                    if saved:
                        self.save_checkpoint()
                        finish(block=True)
                    bar.update(task, advance=1)
                    if self.comm is not None and self.comm.any(bool(stop), "the stop flag"):
                        stop = stop or [signal.SIGTERM]  # another rank was signalled: stop after the same step
                    if stop:
                        self.device.synchronize()
                        finish(block=True)
                        self._handle_faults()
                        if self.checkpoint_every and not saved:
                            self.save_checkpoint()
                        raise Preempted(stop[0], self.step, self.last_checkpoint if self.checkpoint_every else None)
                self.device.synchronize()
                finish(block=True)
                self._handle_faults()
            finally:
                with contextlib.suppress(Exception):  # the steps before a fault keep their records
                    finish(block=True)
                self._open = []
                self._sink = None
        return records

    def _logged_step(self, eval_every: int) -> dict:
        """One training step and its metrics record, whose timing `_final` completes."""
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

    def _final(self, rec: dict, block: bool) -> bool:
        """Complete `rec` once its step's state is final (False while not yet, unless `block`): step_time_s is
        the wall time from the step's start, or from the previous step's final state when that came later (the
        step overlapped it), to its own final state, so back-to-back steps add up to the run's wall time."""
        at = self.engine.final_time(rec["_index"], wait=block)
        if at is None:
            return False
        begin = max(rec.pop("_start"), self._last_final or 0.0)
        self._last_final = at
        rec.pop("_index")
        dt = at - begin
        rec.update(step_time_s=dt, tokens_per_s=self.train.tokens_per_step / dt)
        return True

    def _progress_info(self, rec: dict) -> str:
        val = f" val {rec['val_loss']:.3f}" if rec.get("val_loss") is not None else ""
        if "moe_experts_per_token" in rec:
            val += (f"  experts/token {rec['moe_experts_per_token']:.2f} zero "
                    f"{rec['moe_zero_expert_share']:.0%} max/mean load {rec['moe_load_max_over_mean']:.2f}")
        return (f"loss {rec['loss']:.3f}{val}  {rec['tokens_per_s']:,.0f} tok/s  peak "
                f"{rec['peak_device_bytes'] / 2**20:.1f}/{self.planned_peak_device_bytes / 2**20:.1f} MiB")

    def close(self) -> None:
        """Drain the device and free it, the store and the checkpoint folder's lock; a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.device.synchronize()
        finally:
            self.device.close()
            self._release()
            if getattr(self, "store", None) is not None:
                self.store.close()  # unregisters pinned host memory on cuda; the tensors stay readable

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the test hook -----------------------------------------------------------------------------------------
    def _pause_optimizer(self, step: int) -> None:
        step_unit = self.store.step_unit

        def pausing(unit: str, lr: float, index: int = -1, host_grad: int | None = None) -> None:
            step_unit(unit, lr, index, host_grad)
            if index + 1 == step:
                _pause_here(f"optimizer:{step} after {unit}")

        self.store.step_unit = pausing


def _pause_point() -> tuple[str, int] | None:
    text = os.environ.get(PAUSE_ENV)
    if not text:
        return None
    where, _, step = text.partition(":")
    if where not in ("optimizer", "checkpoint") or not step.isdigit():
        raise ValueError(f"{PAUSE_ENV}={text!r}: expected optimizer:STEP or checkpoint:STEP (a test hook)")
    return where, int(step)


def _pause_here(where: str) -> None:
    print(f"megatrain-test: paused at {where}", file=sys.stderr, flush=True)
    time.sleep(3600)
