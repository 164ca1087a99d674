"""`megatrain plan | tune | probe`: the planner's command line.

Where it sits: the top-level CLI (megatrain/cli.py) calls `add_parser(subparsers)`; a ValueError raised
here is printed there as `error: <one line>` with exit code 2. Try it:
`megatrain plan --model llama3-70b --hardware h100-sxm --gpu-mem 80GiB --seq-len 8192 --micro-batch 1 --json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatrain.files import check_outputs, input_path, output_path, write_atomic

from .bytesize import format_bytes, parse_bytes
from .errors import InfeasiblePlanError
from .hardware import PRESETS, Hardware, resolve_hardware
from .train import TrainSpec

RANK_TOLERANCE = 0.05  # plan --rank-tolerance's default


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan`, `tune` and `probe` on the top-level CLI's subparsers."""
    p = subparsers.add_parser("plan", help="plan one optimizer step: memory, time, bottleneck, before running",
                              description="Plan training of MODEL on HARDWARE under a GPU memory budget. Prints "
                              "peak GPU and host bytes, step time, tokens/s, MFU, the bottleneck, a per-unit "
                              "table and the memory timeline.")
    _common(p)
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
    p.set_defaults(func=run_plan)

    t = subparsers.add_parser("tune", help="plan a grid of GPU budgets x micro-batch sizes; mark the Pareto front",
                              description="Sweep GPU budgets and micro-batch sizes; a row is on the Pareto front "
                              "when no other row reaches at least its tokens/s with no more budget.")
    _common(t)
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
    r.add_argument("--no-cache", action="store_true", help="with --model: measure again even if a profile is "
                   "cached, and do not write the cache")
    r.set_defaults(func=run_probe)


def _common(p: argparse.ArgumentParser, default_hardware: str = "h100-sxm") -> None:
    """The flags plan, tune, train and compile share (runtime/cli.py uses it too)."""
    p.add_argument("--model", required=True, type=input_path, help="a preset name (tiny, llama3-70b, ...) or a .json/.toml config")
    p.add_argument("--hardware", default=default_hardware, type=input_path,
                   help=f"a preset ({', '.join(PRESETS)}) or a profile JSON from `megatrain probe` "
                   f"(default {default_hardware})")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16 or fp32 (default bf16)")
    p.add_argument("--clip-norm", type=float, default=None, help="global gradient-norm clip (default: off)")
    p.add_argument("--host-mem", metavar="BYTES", help="host memory available, overriding the profile's")
    p.add_argument("--depth-mixing", metavar="SPEC", help="override the model's depth mixing: residual, "
                   "denseformer[:KxP], hc[:n], hc-dynamic[:n], attnres[:NB] or depthssd[:N]")
    p.add_argument("--host-policy", metavar="auto|NAME", default="auto", type=_host_policy,
                   help="how the host holds AdamW state: exact, bf16-moments, bf16, fp8, or auto (default): the "
                   "most exact that fits host memory within 0.5%% measured validation-loss cost")
    p.add_argument("--nproc", type=int, default=None, metavar="R",
                   help="data-parallel ranks (GPUs) in all: plan one rank's step, the model state sharded R ways "
                   "and --grad-accum split across ranks (default 1; `train` takes it from torchrun)")
    p.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="nodes the --nproc ranks run on, nproc / nnodes each (default 1)")


def _host_policy(text: str) -> str:
    from .host_policy import read_request

    try:
        return read_request(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model(args: argparse.Namespace):
    """The model config, with --depth-mixing applied."""
    from megatrain.models import load_model_config

    from .depth_rank import with_depth

    config = load_model_config(args.model)
    spec = getattr(args, "depth_mixing", None)
    if spec and Path(args.model).is_dir() and getattr(args, "command", None) == "train":
        raise ValueError(f"--depth-mixing {spec} would train another model than the weights in {args.model} hold; "
                         "fine-tune the model as it is, or train a config file with the mixing from scratch")
    return with_depth(config, spec) if spec else config


def _ranks(text: str | None) -> list[int] | None:
    """--depth-rank for tune: None, 'auto' (1,2,4,8,16) or a comma-separated list."""
    from megatrain.models.depth.spec import RANKS, parse_depth

    if text is None:
        return None
    if text.strip() == "auto":
        return list(RANKS)
    try:
        ranks = [int(x) for x in _split(text, "--depth-rank")]
    except ValueError:
        raise ValueError(f"--depth-rank {text!r} must be auto or comma-separated integers, e.g. 1,4,16") from None
    for n in ranks:
        parse_depth(f"depthssd:{n}")
    return ranks


def _world(args: argparse.Namespace):
    """The World of --nproc / --nnodes (None for one rank), or one line naming the flag."""
    from pydantic import ValidationError

    from .world import World

    nproc, nnodes = getattr(args, "nproc", None), getattr(args, "nnodes", None)
    nproc, nnodes = 1 if nproc is None else nproc, 1 if nnodes is None else nnodes
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be positive integers, got {nproc} and {nnodes}")
    try:
        world = World(nproc=nproc, nnodes=nnodes)
    except ValidationError as e:
        raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None
    if world.nproc > 1:
        world.local_micro_batches(args.grad_accum)
    return world if world.nproc > 1 else None


def _hardware(args: argparse.Namespace) -> Hardware:
    hw = resolve_hardware(args.hardware)
    if args.host_mem is not None:
        host = parse_bytes(args.host_mem)
        if host <= 0:
            raise ValueError(f"--host-mem must be a positive size, e.g. 512GiB (the host memory training may use), "
                             f"got {args.host_mem}")
        hw = hw.replace(host_memory_bytes=host)
    return hw


FLAGS = {"total_steps": "--steps", "warmup_steps": "--warmup"}  # TrainSpec fields whose flag is named apart


def _train(args: argparse.Namespace, micro_batch: int, **fields) -> TrainSpec:
    """The TrainSpec of the flags (and `fields`), or one line naming the flag of the first problem."""
    try:
        return TrainSpec(micro_batch=micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum,
                         dtype=args.dtype, clip_norm=args.clip_norm, **fields)
    except ValueError as e:  # pydantic's ValidationError is a ValueError; keep the first problem, by flag
        errors = getattr(e, "errors", None)
        first = errors()[0] if callable(errors) else {"msg": str(e), "loc": ()}
        field = str(first["loc"][0]) if first.get("loc") else ""
        flag = FLAGS.get(field, f"--{field.replace('_', '-')}") + ": " if field else ""
        raise ValueError(f"bad training settings: {flag}{first['msg'].removeprefix('Value error, ')}") from None


def _load_ir(model: str, train: TrainSpec, hw: Hardware | None = None):
    """The model traced for `train`, for the kernels of `hw`'s device (the sim device runs CPU kernels)."""
    from . import loading

    target = hw.device if hw is not None else "cuda"
    return loading.trace_model(model, train.micro_batch, train.seq_len, train.dtype, target)


def _check_outputs(args: argparse.Namespace, **outputs: str | None) -> None:
    """Every output path, checked before any planning (megatrain.files.check_outputs), and --plot's suffix and
    matplotlib."""
    inputs = {"--model": args.model, "--hardware": args.hardware if Path(args.hardware).exists() else None}
    check_outputs(outputs, inputs)
    if outputs.get("--plot"):
        from megatrain.plots import check_plot_path

        check_plot_path(outputs["--plot"])


def run_plan(args: argparse.Namespace) -> int:
    from .display import format_plan
    from .passes import plan

    _check_outputs(args, **{"--save": args.save, "--trace": args.trace, "--plot": args.plot})
    hw = _hardware(args)
    train = _train(args, args.micro_batch)
    budget = parse_bytes(args.gpu_mem) if args.gpu_mem else hw.gpu_memory_bytes
    config, choice = _model(args), None
    world = _world(args)
    if args.rank_tolerance != RANK_TOLERANCE and (args.depth_rank or "").strip() != "auto":
        raise ValueError("--rank-tolerance applies to --depth-rank auto (how much slower than N=1 a chosen rank may "
                         "be): add --depth-rank auto, or drop --rank-tolerance")
    if world is not None and args.depth_rank is not None:
        raise ValueError("--depth-rank and --nproc together are not supported: plan the chosen rank with "
                         "--depth-mixing depthssd:N --nproc R")
    try:
        if args.depth_rank is None:
            ir = _load_ir(config, train, hw)
            result = plan(ir, hw, train, budget, host_policy=args.host_policy, world=world)
        elif args.depth_rank.strip() == "auto":
            from .depth_rank import choose_rank

            choice = choose_rank(config, hw, train, budget, lambda c, t: _load_ir(c, t, hw), args.rank_tolerance,
                                 host_policy=args.host_policy)
            result = choice.plan
        else:
            from .depth_rank import rank_config

            result = plan(_load_ir(rank_config(config, _ranks(args.depth_rank)[0]), train, hw), hw, train, budget,
                          host_policy=args.host_policy)
    except InfeasiblePlanError as e:
        if not args.json:
            raise
        print(json.dumps({"feasible": False, "error": str(e), "kind": e.kind, "needed_bytes": e.needed_bytes,
                          "gpu_budget_bytes": budget, "dominant": e.dominant}))
        return 2
    if args.save:
        write_atomic(args.save, result.to_json(), "--save")
    if args.trace:
        from .chrome_trace import write_trace

        write_trace(result, args.trace)
    if args.plot:
        from megatrain.plots import plan_figure, save_figure

        from .series import plan_series

        save_figure(plan_figure(plan_series(result)), args.plot)
    rows = None
    if world is not None:
        from .scaling import format_scaling, scaling

        rows = scaling(ir, hw, train, budget, world, args.host_policy)
    if args.json:
        summary = result.summary()
        if rows is not None:
            summary["scaling"] = rows
        if choice is not None:
            summary["depth_rank"] = {"chosen": choice.rank, "tolerance": args.rank_tolerance,
                                     "ranks": list(choice.rows)}
        print(json.dumps(summary))
    else:
        print("".join(line + "\n" for line in (choice.lines if choice else ())), end="")
        print(format_plan(result, explain=args.explain, program=args.program), end="")
        if rows is not None:
            print("\n" + format_scaling(rows, train, world), end="")
        for path, what in ((args.trace, "trace"), (args.save, "plan"), (args.plot, "plot")):
            if path:
                print(f"wrote {what} to {path}")
    return 0


def _split(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list such as 1,2,4")
    return items


def run_tune(args: argparse.Namespace) -> int:
    from .tune import tune

    _check_outputs(args, **{"--plot": args.plot})
    hw = _hardware(args)
    budgets = [parse_bytes(b) for b in _split(args.gpu_mem, "--gpu-mem")]
    try:
        mbs = [int(x) for x in _split(args.micro_batch, "--micro-batch")]
    except ValueError:
        raise ValueError(f"--micro-batch {args.micro_batch!r} must be comma-separated integers, e.g. 1,2,4") from None
    for mb in mbs:
        _train(args, mb)  # each size's settings checked up front, by flag
    train = _train(args, mbs[0])

    def trace_fn(model, mb, spec):
        return _load_ir(model, spec, hw)

    result = tune(_model(args), hw, train, budgets, mbs, trace_fn=trace_fn, depth_ranks=_ranks(args.depth_rank),
                  host_policy=args.host_policy, world=_world(args))
    if args.plot:
        from megatrain.plots import front_figure, save_figure

        from .series import tune_points

        title = f"tune {args.model} on {hw.name}, seq {args.seq_len}, {args.grad_accum} micro-batch(es)/step"
        save_figure(front_figure(tune_points(result), title), args.plot)
    if args.json:
        print(json.dumps({"rows": result.summary()}))
        return 0
    from rich import box
    from rich.table import Table

    from .display import render

    table = Table(box=box.SIMPLE_HEAD, title=f"tune {args.model} on {hw.name}, seq {args.seq_len}, "
                  f"{args.grad_accum} micro-batch(es)/step (* = Pareto front)")
    ranked = any(r.depth_rank is not None for r in result.rows)
    for col in ("", *(("N",) if ranked else ()), "micro-batch", "budget", "peak GPU", "host", "step s", "tokens/s", "MFU", "bottleneck"):
        table.add_column(col, justify="left" if col in ("", "bottleneck") else "right")
    for r in result.rows:
        if r.plan:
            p = r.plan
            table.add_row("*" if r.pareto else "", *((str(r.depth_rank),) if ranked else ()), str(r.micro_batch),
                          format_bytes(r.gpu_budget_bytes),
                          format_bytes(p.peak_gpu_bytes), format_bytes(p.host_bytes), f"{p.step_time_s:.4g}",
                          f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.bottleneck} {p.bottleneck_share:.0%}")
        else:
            table.add_row("", *((str(r.depth_rank),) if ranked else ()), str(r.micro_batch),
                          format_bytes(r.gpu_budget_bytes), "infeasible", "", "", "", "",
                          f"needs {format_bytes(r.needed_bytes or 0)}")
    print(render(table, width=130), end="")
    if args.plot:
        print(f"wrote plot to {args.plot}")
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from .probe import probe

    check_outputs({"--out": args.out}, {"--model": args.model if args.model and Path(args.model).exists() else None})
    model_only = [flag for flag, value, default in (
        ("--seq-len", args.seq_len, None), ("--micro-batch", args.micro_batch, 1), ("--dtype", args.dtype, "bf16"),
        ("--host-policy", args.host_policy, "exact"), ("--repeats", args.repeats, 7),
        ("--sim-threads", args.sim_threads, None), ("--no-cache", args.no_cache, False)) if value != default]
    if args.model is None and model_only:
        raise ValueError(f"{', '.join(model_only)} measure a model's units: add --model M (without it the probe "
                         "measures the machine alone)")
    if args.model is None:
        hw = probe(device=args.device, quick=args.quick)
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

    from megatrain.runtime.unit_probe import cached_hardware, probe_hardware, probe_threads

    from .display import format_units
    from .host_policy import resolve
    from .probe import probe

    if args.seq_len is None or args.seq_len <= 0:
        raise ValueError("probe --model needs --seq-len N (tokens per sequence, as the run will use)")
    if args.micro_batch <= 0 or args.repeats <= 0:
        raise ValueError("probe --model: --micro-batch and --repeats must be positive integers")
    if args.sim_threads is not None and args.sim_threads <= 0:
        raise ValueError(f"--sim-threads must be a positive integer, got {args.sim_threads}")
    policies = [resolve(p).name for p in _split(args.host_policy, "--host-policy")]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "sim" if device == "cpu" else "cuda"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    args.grad_accum, args.clip_norm = 1, None  # the shape of a micro-batch is all a unit's ops depend on
    train = _train(args, args.micro_batch)
    from . import loading

    ir = loading.trace_model(_model(args), train.micro_batch, train.seq_len, train.dtype, device)
    threads = probe_threads(kind, args.sim_threads)
    cached = None if args.no_cache else cached_hardware(ir, kind, threads)
    if cached is not None and all(p in next(iter(cached.units.units.values())).optimizer_s for p in policies):
        print(f"cached profile {cached.units.key} (measured {cached.units.measured_at}); --no-cache measures again")
        print(format_units(cached.units), end="")
        return cached
    machine = probe(device=device, quick=True)
    print(f"measuring {len(set(u.template for u in ir.units))} unit template(s) of {ir.model} on the {kind} device "
          f"({args.repeats} rounds) ...", flush=True)
    hw = probe_hardware(ir, machine, kind, cache=not args.no_cache, policies=policies, repeats=args.repeats,
                        sim_threads=args.sim_threads)
    print(format_units(hw.units), end="")
    if not args.no_cache:
        from .profile import cache_path

        print(f"cached as {cache_path(hw.units.key)}: `megatrain train --hardware auto` plans with it")
    return hw


