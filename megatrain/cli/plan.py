"""`megatrain plan | tune | probe`: the planner's command line.

Where it sits: the CLI (megatrain/cli/__init__.py) calls `add_parser(subparsers)`; a ValueError raised
here is printed there as `error: <one line>` with exit code 2. Try it:
`megatrain plan --model llama3-70b --hardware h100-sxm --gpu-mem 80GiB --seq-len 8192 --micro-batch 1 --json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatrain.files import check_outputs, input_path, output_path, write_atomic
from megatrain.planner.bytesize import format_bytes, parse_bytes
from megatrain.planner.errors import InfeasiblePlanError
from megatrain.planner.hardware import Hardware

from .common import (
    add_common_flags,
    check_paths,
    depth_ranks,
    hardware_of,
    int_list,
    load_ir,
    model_config,
    split_list,
    train_spec,
    world_of,
)

RANK_TOLERANCE = 0.05  # plan --rank-tolerance's default


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan`, `tune` and `probe` on the top-level CLI's subparsers."""
    p = subparsers.add_parser("plan", help="plan one optimizer step: memory, time, bottleneck, before running",
                              description="Plan training of MODEL on HARDWARE under a GPU memory budget. Prints "
                              "peak GPU and host bytes, step time, tokens/s, MFU, the bottleneck, a per-unit "
                              "table and the memory timeline.")
    add_common_flags(p)
    p.add_argument("--gpu-mem", metavar="BYTES", help="GPU memory budget, e.g. 80GiB (default: the GPU's memory)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--explain", action="store_true", help="print each planner pass's decisions and time")
    p.add_argument("--program", action="store_true", help="print the step program, one instruction a line")
    p.add_argument("--trace", metavar="FILE", type=output_path,
                   help="write the predicted timeline as a Chrome/Perfetto trace")
    p.add_argument("--save", metavar="FILE", type=output_path,
                   help="write the whole Plan as JSON (Plan.from_json reads it)")
    p.add_argument("--plot", metavar="FILE", type=output_path, help="draw the step (.png or .svg): memory by kind over predicted "
                   "time against the budget, above the busy intervals of each stream")
    p.add_argument("--depth-rank", metavar="auto|N", help="train with DepthSSD of rank N; auto: the largest N in "
                   "1,2,4,8,16 that fits the budget within --rank-tolerance of N=1's step time")
    p.add_argument("--rank-tolerance", type=float, default=RANK_TOLERANCE, metavar="F",
                   help="with --depth-rank auto: the step-time slowdown over N=1 allowed (default 0.05 = 5%%)")
    p.add_argument("--checkpoint-every", metavar="N", type=_steps,
                   help="price a checkpoint every N steps, written while training goes on: its bytes, the disk's "
                   "time for them (the hardware's disk_write_bytes_per_s) and what it adds to the step, per "
                   "checkpoint and per step; warns when its writes outlast N steps")
    p.set_defaults(func=run_plan)

    t = subparsers.add_parser("tune", help="plan a grid of GPU budgets x micro-batch sizes; mark the Pareto front",
                              description="Sweep GPU budgets and micro-batch sizes (and, given lists, micro-batches "
                              "per step and state places); a row is on the Pareto front when no other row reaches "
                              "at least its tokens/s with no more budget.")
    add_common_flags(t, sweep=True)
    t.add_argument("--gpu-mem", metavar="LIST", required=True, help="comma-separated budgets, e.g. 24GiB,40GiB,80GiB")
    t.add_argument("--micro-batch", metavar="LIST", default="1", help="comma-separated micro-batch sizes (default 1)")
    t.add_argument("--json", action="store_true", help="print one JSON object with every row")
    t.add_argument("--depth-rank", metavar="LIST|auto", help="also sweep DepthSSD's rank N, e.g. 1,4,16 "
                   "(auto: 1,2,4,8,16); the Pareto front is marked per N")
    t.add_argument("--plot", metavar="FILE", type=output_path, help="draw step time and tokens/s against budget per micro-batch, "
                   "the Pareto front marked (.png or .svg)")
    t.set_defaults(func=run_tune)

    r = subparsers.add_parser("probe", help="measure this machine and write a hardware profile",
                              description="Measure matmul throughput per dtype, host copy bandwidth, host AdamW "
                              "throughput and, on CUDA, pinned host<->device bandwidth; print or write the profile. "
                              "With --model, also measure every op the plan of that model runs (each unit "
                              "template's forward and backward at the micro-batch and dtype given, its loads and "
                              "stores, its optimizer step, the per-instruction costs) on the device that runs it, "
                              "and cache the profile: `train --hardware auto` plans with it from then on.")
    r.add_argument("--out", metavar="FILE", type=output_path, help="write the profile JSON here (use it with --hardware FILE)")
    r.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="what to measure (default auto)")
    r.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (seconds, less precise)")
    r.add_argument("--checkpoint-dir", metavar="DIR", type=input_path,
                   help="measure checkpoint writes and reads (write + fsync of a temporary file, read back with "
                   "its sha256) in this folder, where a run will write its checkpoints (default: the temporary folder)")
    r.add_argument("--model", type=input_path, help="also measure this model's units (a preset or config file)")
    r.add_argument("--seq-len", type=int, default=None, help="with --model: tokens per sequence (required)")
    r.add_argument("--micro-batch", type=int, default=1, help="with --model: sequences per micro-batch (default 1)")
    r.add_argument("--dtype", default="bf16", help="with --model: compute dtype, bf16 or fp32 (default bf16)")
    r.add_argument("--host-policy", metavar="LIST", default="exact",
                   help="with --model: host policies whose optimizer step to time, comma-separated (default exact)")
    r.add_argument("--repeats", type=int, default=7, help="with --model: timed rounds per op, median kept (default 7)")
    r.add_argument("--sim-threads", type=int, default=None, metavar="N",
                   help="with --model on cpu: intra-op threads of the sim device's compute stream, as `train "
                   "--sim-threads` (default: torch's)")
    r.add_argument("--refresh", action="store_true", help="with --model: measure again even if a profile is "
                   "cached, and replace it in the cache")
    r.add_argument("--no-cache", action="store_true", help="with --model: measure again even if a profile is "
                   "cached, and do not write the cache")
    r.set_defaults(func=run_probe)


def run_plan(args: argparse.Namespace) -> int:
    from megatrain.planner.advice import optimizer_advice
    from megatrain.planner.display import format_plan
    from megatrain.planner.passes import plan

    check_paths(args, **{"--save": args.save, "--trace": args.trace, "--plot": args.plot})
    hw = hardware_of(args)
    train = train_spec(args, args.micro_batch)
    budget = parse_bytes(args.gpu_mem) if args.gpu_mem else hw.gpu_memory_bytes
    config, choice = model_config(args), None
    world = world_of(args)
    if args.rank_tolerance != RANK_TOLERANCE and (args.depth_rank or "").strip() != "auto":
        raise ValueError("--rank-tolerance applies to --depth-rank auto (how much slower than N=1 a chosen rank may "
                         "be): add --depth-rank auto, or drop --rank-tolerance")
    if world is not None and args.depth_rank is not None:
        raise ValueError("--depth-rank and --nproc together are not supported: plan the chosen rank with "
                         "--depth-mixing depthssd:N --nproc R")
    try:
        if args.depth_rank is None:
            ir = load_ir(config, train, hw)
            result = plan(ir, hw, train, budget, host_policy=args.host_policy, world=world, resident=args.resident)
        elif args.depth_rank.strip() == "auto":
            from megatrain.planner.depth_rank import choose_rank

            choice = choose_rank(config, hw, train, budget, lambda c, t: load_ir(c, t, hw), args.rank_tolerance,
                                 host_policy=args.host_policy, resident=args.resident)
            result = choice.plan
            ir = result.ir  # one rank (depth ranks exclude --nproc): the chunks pass may plan it again
        else:
            from megatrain.planner.depth_rank import rank_config

            ir = load_ir(rank_config(config, depth_ranks(args.depth_rank)[0]), train, hw)
            result = plan(ir, hw, train, budget, host_policy=args.host_policy, resident=args.resident)
        advice = optimizer_advice(result, ir, args.host_policy, args.resident, world)
    except InfeasiblePlanError as e:
        if not args.json:
            raise
        print(json.dumps({"feasible": False, "error": str(e), "kind": e.kind, "needed_bytes": e.needed_bytes,
                          "gpu_budget_bytes": budget, "dominant": e.dominant}))
        return 2
    if args.save:
        write_atomic(args.save, result.to_json(), "--save")
    if args.trace:
        from megatrain.planner.chrome_trace import write_trace

        write_trace(result, args.trace)
    if args.plot:
        from megatrain.planner.series import plan_series
        from megatrain.plots import plan_figure, save_figure

        save_figure(plan_figure(plan_series(result)), args.plot)
    rows = None
    if world is not None:
        from megatrain.planner.scaling import format_scaling, scaling

        rows = scaling(ir, hw, train, budget, world, args.host_policy)
    checkpoint = _checkpoint_cost(result, args.checkpoint_every) if args.checkpoint_every else None
    if args.json:
        summary = result.summary()
        if checkpoint is not None:
            summary["checkpoint"] = checkpoint
        summary["optimizer_binds"] = advice.model_dump() if advice is not None else None
        if rows is not None:
            summary["scaling"] = rows
        if choice is not None:
            summary["depth_rank"] = {"chosen": choice.rank, "tolerance": args.rank_tolerance,
                                     "ranks": list(choice.rows)}
        print(json.dumps(summary))
    else:
        print("".join(line + "\n" for line in (choice.lines if choice else ())), end="")
        print(format_plan(result, explain=args.explain, program=args.program, advice=advice), end="")
        print("".join(f"note: {note}\n" for note in args.hardware_notes), end="")
        if checkpoint is not None:
            print("".join(line + "\n" for line in checkpoint["lines"]), end="")
        if rows is not None:
            print("\n" + format_scaling(rows, train, world), end="")
        for path, what in ((args.trace, "trace"), (args.save, "plan"), (args.plot, "plot")):
            if path:
                print(f"wrote {what} to {path}")
    return 0




def _steps(text: str) -> int:
    """--checkpoint-every: a whole number of steps, >= 1, in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, e.g. 100, got {text!r}")
    return int(text)


def _checkpoint_cost(result, every: int) -> dict:
    """What a checkpoint every `every` steps costs under plan `result` (planner/checkpoint_writes.py), for the
    summary: its figures, and the lines the table prints (a refusal's one line where there is no price)."""
    from megatrain.planner.checkpoint_writes import CheckpointPlanError, checkpoint_cost

    resume = _resume_cost(result)
    try:
        cost = checkpoint_cost(result)
    except CheckpointPlanError as e:
        return {"every": every, "streamed": False, "reason": str(e), "lines": [f"checkpoint: {e}", resume["line"]],
                "resume": resume}
    return {"every": every, "streamed": True, "bytes": cost.bytes, "write_s": cost.write_s,
            "disk_bytes_per_s": cost.disk_bytes_per_s, "step_time_s": cost.step_s,
            "checkpoint_step_time_s": cost.checkpoint_step_s, "extra_s": cost.extra_s,
            "per_step_s": cost.per_step_s(every), "warning": cost.check(every),
            "lines": [*cost.lines(every), resume["line"]], "resume": resume}


def _resume_cost(result) -> dict:
    """What a resume from one of those checkpoints costs its first step (planner/checkpoint_reads.py): read
    while the step trains, or (a world) before it."""
    from megatrain.planner.checkpoint_reads import ResumePlanError, resume_cost

    try:
        cost = resume_cost(result)
    except ResumePlanError as e:
        return {"streamed": False, "reason": str(e), "line": f"resume: the checkpoint is read before the first step: {e}"}
    return {"streamed": True, "bytes": cost.bytes, "before_bytes": cost.before_bytes, "read_s": cost.read_s,
            "disk_bytes_per_s": cost.disk_bytes_per_s, "first_step_s": cost.streamed_s,
            "first_step_synchronous_s": cost.synchronous_s, "line": cost.line()}


def run_tune(args: argparse.Namespace) -> int:
    from megatrain.planner.tune import tune

    check_paths(args, **{"--plot": args.plot})
    hw = hardware_of(args)
    budgets = [parse_bytes(b) for b in split_list(args.gpu_mem, "--gpu-mem")]
    try:
        mbs = [int(x) for x in split_list(args.micro_batch, "--micro-batch")]
    except ValueError:
        raise ValueError(f"--micro-batch {args.micro_batch!r} must be comma-separated integers, e.g. 1,2,4") from None
    accums = int_list(args.grad_accum, "--grad-accum")
    worlds = []
    for k in accums:  # each setting checked up front, by flag
        one = argparse.Namespace(**{**vars(args), "grad_accum": k})
        worlds.append(world_of(one))
        for mb in mbs:
            train_spec(one, mb)
    train = train_spec(argparse.Namespace(**{**vars(args), "grad_accum": accums[0]}), mbs[0])

    def trace_fn(model, mb, spec):
        return load_ir(model, spec, hw)

    result = tune(model_config(args), hw, train, budgets, mbs, trace_fn=trace_fn, depth_ranks=depth_ranks(args.depth_rank),
                  host_policy=args.host_policy, world=worlds[0], grad_accums=accums, residents=args.resident)
    steps = "/".join(map(str, accums))
    if args.plot:
        from megatrain.planner.series import tune_points
        from megatrain.plots import front_figure, save_figure

        title = f"tune {args.model} on {hw.name}, seq {args.seq_len}, {steps} micro-batch(es)/step"
        save_figure(front_figure(tune_points(result), title), args.plot)
    if args.json:
        print(json.dumps({"rows": result.summary()}))
        return 0
    from rich import box
    from rich.table import Table

    from megatrain.planner.display import render

    table = Table(box=box.SIMPLE_HEAD, title=f"tune {args.model} on {hw.name}, seq {args.seq_len}, "
                  f"{steps} micro-batch(es)/step (* = Pareto front)")
    ranked = any(r.depth_rank is not None for r in result.rows)
    for col in ("", *(("N",) if ranked else ()), "micro-batch", "accum", "resident", "budget", "peak GPU", "host",
                "step s", "tokens/s", "MFU", "bottleneck"):
        table.add_column(col, justify="left" if col in ("", "resident", "bottleneck") else "right")
    for r in result.rows:
        cells = ("*" if r.pareto else "", *((str(r.depth_rank),) if ranked else ()), str(r.micro_batch),
                 str(r.grad_accum))
        if r.plan:
            p = r.plan
            units = f"{r.resident}: {len(p.resident_units)} unit(s)" if p.resident_units else r.resident
            table.add_row(*cells, units, format_bytes(r.gpu_budget_bytes),
                          format_bytes(p.peak_gpu_bytes), format_bytes(p.host_bytes), f"{p.step_time_s:.4g}",
                          f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.bottleneck} {p.bottleneck_share:.0%}")
        else:
            table.add_row(*cells, r.resident, format_bytes(r.gpu_budget_bytes), "infeasible", "", "", "", "",
                          f"needs {format_bytes(r.needed_bytes or 0)}")
    print(render(table, width=130), end="")
    print("".join(f"note: {note}\n" for note in args.hardware_notes), end="")
    if args.plot:
        print(f"wrote plot to {args.plot}")
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from megatrain.runtime.machine_probe import probe

    check_outputs({"--out": args.out}, {"--model": args.model if args.model and Path(args.model).exists() else None})
    model_only = [flag for flag, value, default in (
        ("--seq-len", args.seq_len, None), ("--micro-batch", args.micro_batch, 1), ("--dtype", args.dtype, "bf16"),
        ("--host-policy", args.host_policy, "exact"), ("--repeats", args.repeats, 7),
        ("--sim-threads", args.sim_threads, None), ("--no-cache", args.no_cache, False),
        ("--refresh", args.refresh, False)) if value != default]
    if args.model is None and model_only:
        raise ValueError(f"{', '.join(model_only)} measure a model's units: add --model M (without it the probe "
                         "measures the machine alone)")
    if args.model is None:
        hw = probe(device=args.device, quick=args.quick, disk=args.checkpoint_dir)
    else:
        hw = _probe_model(args)
    if args.out:
        write_atomic(args.out, hw.to_json(indent=2) + "\n", "--out")
        print(f"{hw.describe()}\nwrote {args.out}")
    elif args.model is None:
        print(hw.to_json(indent=2))
    return 0


def _probe_model(args: argparse.Namespace) -> Hardware:
    """The machine's profile with the measured UnitProfile of --model (cached; see planner/profile.py)."""
    import torch

    from megatrain.planner.display import format_units
    from megatrain.planner.host_policy import resolve
    from megatrain.runtime.machine_probe import probe
    from megatrain.runtime.unit_probe import cached_hardware, probe_hardware, probe_threads

    if args.seq_len is None or args.seq_len <= 0:
        raise ValueError("probe --model needs --seq-len N (tokens per sequence, as the run will use)")
    if args.micro_batch <= 0 or args.repeats <= 0:
        raise ValueError("probe --model: --micro-batch and --repeats must be positive integers")
    if args.sim_threads is not None and args.sim_threads <= 0:
        raise ValueError(f"--sim-threads must be a positive integer, got {args.sim_threads}")
    policies = [resolve(p).name for p in split_list(args.host_policy, "--host-policy")]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "sim" if device == "cpu" else "cuda"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    args.grad_accum, args.clip_norm = 1, None  # the shape of a micro-batch is all a unit's ops depend on
    train = train_spec(args, args.micro_batch)
    from megatrain.planner import loading

    ir = loading.trace_model(model_config(args), train.micro_batch, train.seq_len, train.dtype, device)
    threads = probe_threads(kind, args.sim_threads)
    if args.refresh and args.no_cache:
        raise ValueError("--refresh replaces the cached profile and --no-cache leaves the cache alone: pass one")
    cached = None if args.no_cache or args.refresh else cached_hardware(ir, kind, threads)
    if cached is not None and all(p in next(iter(cached.units.units.values())).optimizer_s for p in policies):
        print(f"cached profile {cached.units.key} (measured {cached.units.measured_at}); --refresh measures again "
              "and replaces it")
        print(format_units(cached.units), end="")
        _say_spread(cached.units)
        return cached
    machine = probe(device=device, quick=True, disk=args.checkpoint_dir)
    print(f"measuring {len(set(u.template for u in ir.units))} unit template(s) of {ir.model} on the {kind} device "
          f"({args.repeats} rounds) ...", flush=True)
    hw = probe_hardware(ir, machine, kind, cache=not args.no_cache, policies=policies, repeats=args.repeats,
                        sim_threads=args.sim_threads)
    print(format_units(hw.units), end="")
    _say_spread(hw.units)
    if not args.no_cache:
        from megatrain.planner.profile_cache import cache_path

        print(f"cached as {cache_path(hw.units.key)}: `megatrain train --hardware auto` plans with it")
    return hw


def _say_spread(units) -> None:
    """How far the timed rounds were apart; a warning when far enough that a busy machine is the likelier cause."""
    import sys

    from megatrain.runtime.unit_probe import SPREAD_WARN

    if not units.spread:
        return
    (op, spread), = units.spread.items()
    print(f"rounds agree within {spread:.0%} (interquartile range over median; widest: {op})")
    if spread > SPREAD_WARN:
        print(f"warning: the probe's rounds disagree by {spread:.0%} ({op}): the machine was probably busy; its "
              "plans may be off. Measure again when it is idle: the same command with --refresh", file=sys.stderr)
