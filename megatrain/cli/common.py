"""What the verbs share: the model, hardware, world and training flags, and turning them into values.

Every problem is raised as a ValueError naming the flag (megatrain.cli prints it as one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatrain.files import check_outputs, input_path
from megatrain.models.depth.spec import FORMS
from megatrain.planner.bytesize import format_bytes, parse_bytes
from megatrain.planner.hardware import PRESETS, Hardware, resolve_hardware
from megatrain.planner.train import TrainSpec

NOMINAL = "h100-sxm"  # what hardware auto plans for where no GPU is here and nothing will run (plan, tune, compile)


def add_common_flags(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The flags plan, tune, train and compile share; with `sweep` (tune), --grad-accum and --resident take
    comma-separated lists."""
    p.add_argument("--model", required=True, type=input_path, help="a preset name (tiny, llama3-70b, ...) or a .json/.toml config")
    p.add_argument("--hardware", default="auto", type=input_path,
                   help=f"a preset ({', '.join(PRESETS)}) or a profile JSON from `megatrain probe`; default auto: "
                   "this machine (its GPU, or train's sim device the cpu profile; host memory this machine's less "
                   f"10%%, at least 2 GiB), and where plan, tune or compile find no GPU, the nominal {NOMINAL}")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    if sweep:
        p.add_argument("--grad-accum", metavar="LIST", default="1", help="comma-separated micro-batches per "
                       "optimizer step, e.g. 1,4,16 (default 1): a larger one steps the host optimizer once over "
                       "more tokens")
    else:
        p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16 or fp32 (default bf16)")
    p.add_argument("--clip-norm", type=float, default=None, help="global gradient-norm clip (default: off; 0 "
                   "turns it off, as under --recipe hf-trainer's 1.0)")
    p.add_argument("--host-mem", metavar="BYTES", help="host memory available, overriding the profile's")
    p.add_argument("--depth-mixing", metavar="SPEC", help="override the model's depth mixing: " + FORMS)
    p.add_argument("--host-policy", metavar="auto|NAME", default="auto", type=host_policy_arg,
                   help="how the host holds AdamW state: exact, bf16-moments, bf16, fp8, or auto (default): the "
                   "most exact that fits host memory within 0.5%% measured validation-loss cost")
    if sweep:
        p.add_argument("--resident", metavar="LIST", default="auto", type=resident_list,
                       help="comma-separated state places to plan with: auto, none or auto,none (default auto)")
    else:
        p.add_argument("--resident", choices=RESIDENT, default="auto",
                       help="where each unit's weights, gradients and AdamW state live: auto (default) lets the "
                       "planner keep units on the GPU where the budget has room and that shortens the step "
                       "(docs/PLANNING.md); none streams every unit from the host")
    p.add_argument("--nproc", type=int, default=None, metavar="R",
                   help="data-parallel ranks (GPUs) in all: plan one rank's step, the model state sharded R ways "
                   "and --grad-accum split across ranks (default 1; `train` takes it from torchrun)")
    p.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="nodes the --nproc ranks run on, nproc / nnodes each (default 1)")


RESIDENT = ("auto", "none")  # --resident's values: the planner's residency pass decides, or every unit streams


def resident_list(text: str) -> list[str]:
    """tune's --resident: auto, none or both, comma-separated."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in RESIDENT]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"--resident takes auto, none or auto,none, got {text!r}")
    return list(dict.fromkeys(items))


def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma-separated positive integers, or one line naming it."""
    try:
        values = [int(x) for x in split_list(text, flag)]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r} must be positive integers, e.g. 1,2,4")
    return values


def host_policy_arg(text: str) -> str:
    from megatrain.planner.host_policy import read_request

    try:
        return read_request(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_config(args: argparse.Namespace):
    """The model config, with --depth-mixing applied."""
    from megatrain.models import load_model_config
    from megatrain.planner.depth_rank import with_depth

    config = load_model_config(args.model)
    spec = getattr(args, "depth_mixing", None)
    return with_depth(config, spec) if spec else config


def depth_ranks(text: str | None) -> list[int] | None:
    """--depth-rank for tune: None, 'auto' (1,2,4,8,16) or a comma-separated list."""
    from megatrain.models.depth.spec import RANKS, parse_depth

    if text is None:
        return None
    if text.strip() == "auto":
        return list(RANKS)
    try:
        ranks = [int(x) for x in split_list(text, "--depth-rank")]
    except ValueError:
        raise ValueError(f"--depth-rank {text!r} must be auto or comma-separated integers, e.g. 1,4,16") from None
    for n in ranks:
        parse_depth(f"depthssd:{n}")
    return ranks


def world_of(args: argparse.Namespace):
    """The World of --nproc / --nnodes (None for one rank), or one line naming the flag."""
    from pydantic import ValidationError

    from megatrain.planner.world import World

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


def hardware_of(args: argparse.Namespace) -> Hardware:
    """The profile of --hardware and --host-mem. auto is this machine's GPU (`train` decides for itself, in
    runtime/build.py), else the nominal preset; `args.hardware_notes` says where the figures came from."""
    args.hardware_notes = []
    if args.hardware == "auto":
        hw = _this_machine(args)
    else:
        hw = resolve_hardware(args.hardware)
        if args.host_mem is None and args.hardware in PRESETS:
            args.hardware_notes.append(f"host memory {format_bytes(hw.host_memory_bytes)}: the {hw.name} preset's "
                                       "(pass --host-mem for the machine that will train)")
    if args.host_mem is not None:
        host = parse_bytes(args.host_mem)
        if host <= 0:
            raise ValueError(f"--host-mem must be a positive size, e.g. 512GiB (the host memory training may use), "
                             f"got {args.host_mem}")
        hw = hw.replace(host_memory_bytes=host)
    return hw


def _this_machine(args: argparse.Namespace) -> Hardware:
    import torch

    from megatrain.planner.hardware import hardware_for_device, hardware_preset
    from megatrain.runtime.build import machine_host_bytes

    if not torch.cuda.is_available():
        hw = hardware_preset(NOMINAL)
        args.hardware_notes.append(f"hardware auto: no GPU here, so planned for the nominal {NOMINAL} with its "
                                   f"{format_bytes(hw.host_memory_bytes)} of host memory (name the target with "
                                   "--hardware, its host memory with --host-mem)")
        return hw
    hw = hardware_for_device("cuda")
    host = machine_host_bytes()
    if host is not None and args.host_mem is None:
        args.hardware_notes.append(f"hardware auto: this machine's {hw.name}, host memory "
                                   f"{format_bytes(host)} (its memory less 10%, at least 2 GiB, for the system)")
        hw = hw.replace(host_memory_bytes=host)
    return hw


FLAGS = {"total_steps": "--steps", "warmup_steps": "--warmup"}  # TrainSpec fields whose flag is named apart


def train_spec(args: argparse.Namespace, micro_batch: int, **fields) -> TrainSpec:
    """The TrainSpec of the flags (and `fields`), or one line naming the flag of the first problem."""
    try:
        return TrainSpec(micro_batch=micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum,
                         dtype=args.dtype, clip_norm=args.clip_norm or None, **fields)  # 0: off, as train's
    except ValueError as e:  # pydantic's ValidationError is a ValueError; keep the first problem, by flag
        errors = getattr(e, "errors", None)
        first = errors()[0] if callable(errors) else {"msg": str(e), "loc": ()}
        field = str(first["loc"][0]) if first.get("loc") else ""
        flag = FLAGS.get(field, f"--{field.replace('_', '-')}") + ": " if field else ""
        raise ValueError(f"bad training settings: {flag}{first['msg'].removeprefix('Value error, ')}") from None


def load_ir(model: str, train: TrainSpec, hw: Hardware | None = None):
    """The model traced for `train`, for the kernels of `hw`'s device (the sim device runs CPU kernels)."""
    from megatrain.planner import loading

    target = hw.device if hw is not None else "cuda"
    return loading.trace_model(model, train.micro_batch, train.seq_len, train.dtype, target)


def check_paths(args: argparse.Namespace, **outputs: str | None) -> None:
    """Every output path, checked before any planning (megatrain.files.check_outputs), and --plot's suffix and
    matplotlib."""
    inputs = {"--model": args.model, "--hardware": args.hardware if Path(args.hardware).exists() else None}
    check_outputs(outputs, inputs)
    if outputs.get("--plot"):
        from megatrain.plots import check_plot_path

        check_plot_path(outputs["--plot"])




def split_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list such as 1,2,4")
    return items
