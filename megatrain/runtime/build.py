"""Building a run from its RunConfig: the model, the data, the device, the hardware profile, the plan, the host
store and the engine.

Where it sits: the Trainer (trainer.py) calls these in order, cheap checks first, so a bad data file is
reported before anything big is allocated and the host memory is checked before the store takes it.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch

from megatrain.ir.trace import trace
from megatrain.models import load_model_config
from megatrain.planner import Plan, plan
from megatrain.planner.bytesize import format_bytes, parse_bytes
from megatrain.planner.hardware import Hardware, hardware_for_device, resolve_hardware

from .config import RunConfig
from .cpus import resolve as resolve_cpus
from .data import Batcher, DataError, TokenFile, check_sizes
from .device import make_device
from .engine import Engine
from .examples import ExampleBatcher
from .store import HostStore
from .stream_device import Device
from .tokenizer import check_made_with

HOST_MEM_ENV = "MEGATRAIN_HOST_MEM"  # the host memory to plan and check against, for a machine that grows it


class HostMemoryError(ValueError):
    """The plan needs more host memory than the machine has available."""


def model_of(cfg: RunConfig):
    """The model config (with depth_mixing applied) and, for a Hugging Face model folder, the folder: training
    starts from its weights, and its config and tokenizer files travel in every checkpoint."""
    from megatrain.planner.depth_rank import with_depth

    folder = Path(cfg.model) if isinstance(cfg.model, str) and Path(cfg.model).is_dir() else None
    if cfg.depth_mixing and folder is not None:
        raise ValueError(f"--depth-mixing {cfg.depth_mixing} would train another model than the weights in "
                         f"{cfg.model} hold; fine-tune the model as it is, or train a config file with the mixing "
                         "from scratch")
    config = load_model_config(cfg.model)
    return (with_depth(config, cfg.depth_mixing) if cfg.depth_mixing else config), folder


def default_corpus(model) -> tuple[str, str]:
    """(train, val) token files of the built-in corpus, what a run without data trains on (the CLI's and the
    Python API's alike): tokenized with a model folder's own tokenizer when it has one, else bytes."""
    from .corpus import cached_default_corpus

    folder = Path(model) if isinstance(model, str) else None
    tokenizer = folder if folder and folder.is_dir() and (folder / "tokenizer.json").is_file() else None
    train_path, val_path = cached_default_corpus(tokenizer=tokenizer)
    return str(train_path), str(val_path)


def open_data(path, config, model_dir: Path | None) -> TokenFile:
    """A token file checked against the model: its ids fit the vocabulary, and a model folder with its own
    tokenizer trains only on data made with that tokenizer."""
    tf = TokenFile.open(path, vocab_size=config.vocab_size)
    made_for = tf.meta.get("vocab_size")
    if isinstance(made_for, int) and made_for > config.vocab_size:
        raise DataError(f"{path}: was prepared with a tokenizer of {made_for:,} ids but the model's vocab_size is "
                        f"{config.vocab_size:,}; prepare the data with the model's tokenizer")
    if model_dir is not None:
        check_made_with(Path(path), tf.meta, model_dir)
    return tf


def data_of(cfg: RunConfig, config, model_dir: Path | None):
    """(data, val_data, pack, batcher): the files opened, whether examples are packed, the training batcher.
    A validation file too short for one batch is refused now, not hours in."""
    t = cfg.train
    data = open_data(cfg.data, config, model_dir) if cfg.data else None
    val = open_data(cfg.val_data, config, model_dir) if cfg.val_data else None
    if val is not None:
        if val.examples is None:
            check_sizes(val, micro_batch=t.micro_batch, seq_len=t.seq_len, n_batches=1)
        else:
            ExampleBatcher(val, t.micro_batch, t.seq_len, 1, seed=0, shuffle=False)
    pack = cfg.pack is not False and data is not None and data.examples is not None
    if cfg.pack and not pack:
        raise DataError(f"{cfg.data}: packing needs instruction data (examples); a token stream is cut into "
                        "windows: drop --pack, or prepare chat or alpaca JSONL")
    if data is None:
        batcher = None
    elif data.examples is not None:
        batcher = ExampleBatcher(data, t.micro_batch, t.seq_len, t.grad_accum, t.seed, pack=pack)
    else:
        batcher = Batcher(data, t.micro_batch, t.seq_len, t.grad_accum, t.seed)
    return data, val, pack, batcher


def device_kind(device: str) -> str:
    """`auto`: cuda when torch sees a GPU, else sim; cuda without one is refused."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device sim")
    return device


def hardware_of(cfg: RunConfig, device: str, comm=None) -> Hardware:
    """The profile to plan with: auto is the device's own (the cpu preset for sim, the GPU's preset on cuda)
    with this machine's host memory less its headroom (`machine_host_bytes`); host_mem, given, wins."""
    index = comm.local_rank if comm is not None and device == "cuda" else 0  # the GPU make_device takes
    hw = hardware_for_device(device, index) if cfg.hardware == "auto" else resolve_hardware(cfg.hardware)
    host = cfg.host_mem if cfg.host_mem is not None else machine_host_bytes() if cfg.hardware == "auto" else None
    return hw if host is None else hw.replace(host_memory_bytes=host)


HOST_HEADROOM = 0.10, 2 * 2**30  # the share of this machine's memory (at least this many bytes) left to others


def machine_host_bytes() -> int | None:
    """The host memory a run planned for this machine may take: its physical memory (or its cgroup's limit, if
    lower; HOST_MEM_ENV, when set, instead) less a headroom of 10%, at least 2 GiB, for the operating system,
    the page cache and other processes. None where unknown. Presets keep their own figure: they describe
    another machine."""
    given = os.environ.get(HOST_MEM_ENV, "").strip()
    if given:
        return available_host_bytes()  # the stated figure, checked there
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit != "max" else total
    except (OSError, ValueError):
        pass
    share, least = HOST_HEADROOM
    left = total - max(int(total * share), least)
    return left if left > 0 else None


def device_of(cfg: RunConfig, device: str, comm=None, delays: tuple[float, float] | None = None) -> Device:
    kw = {"delays": delays} if delays and device == "sim" else {}
    if comm is not None and device == "cuda":
        kw["index"] = comm.local_rank
    if cfg.sim_threads is not None and device == "sim":
        kw["cpu"] = resolve_cpus("sim", sim_threads=cfg.sim_threads)
    return make_device(device, budget_bytes=cfg.gpu_mem, **kw)


def check_compile(cfg: RunConfig, config, device: Device) -> None:
    if not cfg.compile_units:
        return
    from .compiled import check_toolchain

    if config.moe is not None:
        raise ValueError(f"--compile-units compiles dense models' blocks; {config.name} routes tokens to experts "
                         "(MoE), whose blocks run eagerly: drop --compile-units")
    check_toolchain(device.kind)


def profiled(ir, hardware: Hardware, device: Device, comm=None, loss_chunk: int = 1024,
             compiled: bool = False) -> tuple[Hardware, str]:
    """The hardware to plan with under profile="auto", and how it was obtained: this machine's cached probe of
    the model's units (runtime/unit_probe.py) when one exists, its sizes those of the profile given; else the
    profile given. Only the plan's speed depends on it: any schedule trains to the same bits (a long sequence's
    tile size, which the chunks pass also picks by speed, to fp32 round-off). In a world every rank plans with
    the profile given: each node has a cache of its own, and the ranks' programs must agree."""
    if comm is not None:
        return hardware, (f"planned with the {hardware.name} profile: in a world the ranks plan alike, without a "
                          "node's cached probe (pass a probed profile as --hardware FILE)")
    from .unit_probe import cached_hardware, device_threads

    cached = cached_hardware(ir, device.kind, device_threads(device), loss_chunk, compiled=compiled)
    if cached is None:
        return hardware, (f"planned with the {hardware.name} profile: no probe of {ir.model} at this micro-batch, "
                          "sequence length and dtype is cached for this machine; `megatrain probe --model ...` "
                          "with the same settings measures one")
    from megatrain.planner.profile_cache import cache_path

    note = (f"planned with the probe of this machine measured {cached.units.measured_at}, cached as "
            f"{cache_path(cached.units.key)} (name a preset with --hardware to plan without it)")
    # NOTE: a probe measures speeds; the sizes stay those of the hardware given (its --host-mem, a GPU's memory)
    return cached.replace(host_memory_bytes=hardware.host_memory_bytes,
                          gpu_memory_bytes=hardware.gpu_memory_bytes), note


def plan_of(cfg: RunConfig, config, device: Device, hardware: Hardware, host_policy: str, pack: bool,
            comm=None) -> tuple[Plan, Hardware, str]:
    """The plan of one step, the hardware it was made with and how that was chosen. A skip under on_nan="skip"
    is all or nothing for the step, so the host optimizer waits for every gradient (the planner's barrier)."""
    t = cfg.train
    ir = trace(config, t.micro_batch, t.seq_len, t.dtype, loss_chunk=cfg.loss_chunk,
               target="cpu" if device.kind == "sim" else "cuda", packed=pack)
    if cfg.compile_units:  # a compiled unit's fused attention is not replayable (models/replay.py)
        ir = ir.without_replay()
    note = ""
    if cfg.profile == "auto":
        hardware, note = profiled(ir, hardware, device, comm, cfg.loss_chunk, cfg.compile_units)
    world = None
    if comm is not None:
        from megatrain.planner.world import World

        world = World(nproc=comm.size, nnodes=comm.nnodes)
    the_plan = plan(ir, hardware, t, cfg.gpu_mem, host_policy=host_policy, world=world,
                    barrier=cfg.on_nan == "skip", resident=cfg.resident)
    return the_plan, hardware, note


def plan_sha256(the_plan: Plan) -> str:
    return hashlib.sha256(the_plan.program.to_json().encode()).hexdigest()


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


def check_memory(the_plan: Plan, device: Device, comm=None) -> None:
    """Refuse to allocate a store the machine cannot hold (on the sim device, the device's buffers and
    workspace are host memory too; in a world, what every rank of this node will hold), then hold the device
    to the plan's budget."""
    local = comm.local_size if comm is not None else 1
    node = (comm.rank if comm is not None else 0) // local
    shares = the_plan.host_bytes_per_rank or (the_plan.host_bytes,)
    need = sum(shares[node * local : (node + 1) * local]) + local * (
        the_plan.peak_gpu_bytes if device.kind == "sim" else 0)
    avail = available_host_bytes()
    if avail is not None and need > avail:
        raise HostMemoryError(
            f"the plan needs {format_bytes(need)} ({need:,} bytes) of host memory for weights, gradients and "
            f"AdamW states but only {format_bytes(avail)} ({avail:,} bytes) is available; free memory, use a "
            "machine with more RAM, or train a smaller model")
    # the process is held to the budget the plan was made for, less the reserve the plan keeps for what the
    # allocator never sees (CUDA context, library workspaces)
    device.limit_allocator(the_plan.gpu_budget_bytes - the_plan.hardware.reserved_bytes)


def check_same_data(batcher, comm) -> None:
    """Every rank draws its part of each global batch from the same data order: the ranks' data (its size,
    sidecar hash and fingerprint, with the order's settings) must agree before any step, not only at a
    resume, where the checkpoint records rank 0's alone."""
    mine = None if batcher is None else {k: v for k, v in batcher.state(0).items() if k not in ("data", "step")}
    every = comm.gather_objects(mine, what="the ranks' data")
    other = next((r for r, d in enumerate(every) if d != every[0]), None)
    if other is not None:
        theirs, first = every[other] or {}, every[0] or {}
        diff = [k for k in sorted({*theirs, *first}) if theirs.get(k) != first.get(k)]
        raise DataError(f"rank {other} reads other data than rank 0 ({', '.join(diff) or '--data given to one'} "
                        "differ): every rank must be given the same --data file (each trains on its own part of "
                        "every batch)")


def store_of(the_plan: Plan, cfg: RunConfig, device: Device, init: bool, batcher=None, comm=None):
    """The host store of the plan, and the seconds its creation took (the time to the first step: first touch
    and initial weights, runtime/host_init.py). Every rank checked its host memory and planned the same step
    before anyone allocates."""
    t = cfg.train
    if comm is not None:
        hashes = comm.gather_objects(plan_sha256(the_plan), what="the ranks' plans")
        if len(set(hashes)) > 1:
            other = next(r for r, h in enumerate(hashes) if h != hashes[0])
            raise ValueError(f"rank {other} planned another step program than rank 0: give every rank the same "
                             "flags, model, hardware profile and megatrain version")
        check_same_data(batcher, comm)
    created = time.perf_counter()
    if comm is None:
        store = HostStore(the_plan.ir, t, seed=t.seed, policy=the_plan.host_policy, program=the_plan.program,
                          device=device.kind, init=init)
    else:
        from .sharded_store import ShardedHostStore

        store = ShardedHostStore(the_plan.ir, t, seed=t.seed, policy=the_plan.host_policy,
                                 program=the_plan.program, comm=comm, device=device.kind, init=init)
    seconds = time.perf_counter() - created
    store.check_finite = True
    store.stop_on_fault = cfg.on_nan == "abort"
    return store, seconds


def engine_of(the_plan: Plan, cfg: RunConfig, device: Device, store, comm=None) -> Engine:
    return Engine(the_plan.ir, the_plan.program, device, store, loss_chunk=cfg.loss_chunk, comm=comm,
                  compile_units=cfg.compile_units)
