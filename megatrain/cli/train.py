"""`megatrain train | compile | export`: running the pipeline.

Where it sits: the CLI (megatrain/cli/__init__.py) calls `add_parser(subparsers)`. `train` runs the whole
pipeline (trace, plan, compile, run) through runtime.trainer.Trainer, with checkpoints and resume;
`compile` stops after codegen and writes the step program; `export` writes a checkpoint as a Hugging Face
model folder, or its weights as safetensors files (runtime/export.py).
Try it: `megatrain train --model tiny --device sim --gpu-mem 6MiB --seq-len 64 --micro-batch 2 --steps 20`.

Every flag is checked before anything is allocated: a value a user can get wrong is answered in one line
(ValueError -> `error: ...`, exit 2), and output paths are tried for writing before training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from megatrain.files import (
    check_output_file,
    check_outputs,
    input_path,
    output_path,
    writable_dir,
    write_atomic,
)
from megatrain.planner.bytesize import format_bytes, parse_bytes
from megatrain.planner.train import RECIPES

from .common import add_common_flags, hardware_of, load_ir, model_config, train_spec, world_of


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    t = subparsers.add_parser("train", help="train a model, streamed through a (real or simulated) GPU",
                              description="Plan, compile and run streamed training. Parameters, gradients and "
                              "AdamW states live in host memory; the device holds only what the plan says.")
    t.add_argument("--config", metavar="RUN.toml", type=_run_file, action=_Once, help="a run file holding any of these "
                   "settings (model, data, optimizer, schedule, budget, checkpointing); flags given here override it")
    add_common_flags(t)
    t.add_argument("--device", choices=("sim", "cuda", "auto"), default="auto",
                   help="sim: CPU-backed simulated GPU; cuda: the real one; auto: cuda if present (default)")
    t.add_argument("--gpu-mem", metavar="BYTES", required=True, help="device memory budget, e.g. 40MiB or 80GiB")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    t.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    t.add_argument("--recipe", choices=tuple(RECIPES), help="a whole set of optimizer defaults: megatrain "
                   "(default: pretraining's, as listed here) or hf-trainer (the Hugging Face Trainer's: lr 5e-5, "
                   "linear to 0, no warmup and HF's warmup ramp, weight decay 0, betas 0.9,0.999, clip 1.0); "
                   "flags given override it (docs/FINETUNING.md maps TrainingArguments to flags)")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps)")
    t.add_argument("--warmup-style", choices=("megatrain", "hf"), help="the warmup ramp at step s (0-based) of W: "
                   "megatrain lr*(s+1)/W (default), or hf lr*s/W as transformers' schedulers (the first step at lr 0)")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay, on weight "
                   "matrices only (not norms, biases or depth-mixing coefficients; default 0.1)")
    t.add_argument("--betas", default="0.9,0.95", metavar="B1,B2", help="AdamW betas (default 0.9,0.95)")
    t.add_argument("--eps", type=float, default=1e-8, help="AdamW epsilon (default 1e-8)")
    t.add_argument("--schedule", choices=("cosine", "linear", "constant", "wsd"), default="cosine",
                   help="learning rate after warmup: cosine or linear decay to --min-lr-ratio x --lr at the last "
                   "step, constant, or wsd (constant, then linear decay over the last --decay-fraction of the "
                   "steps); default cosine")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="the schedule's floor as a fraction of --lr "
                   "(default 0.1)")
    t.add_argument("--decay-fraction", type=float, default=0.2, help="with --schedule wsd: the fraction of the "
                   "post-warmup steps that decays (default 0.2)")
    t.add_argument("--seed", type=int, default=0, help="seed for init and data order (default 0)")
    t.add_argument("--data", metavar="FILE", type=input_path, help="training token file (default: the built-in corpus)")
    t.add_argument("--val-data", metavar="FILE", type=input_path, help="validation token file (default: the built-in corpus's, "
                   "when --data is not given)")
    t.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="instruction data: pack several examples into each sequence, attending within each "
                   "(default), or --no-pack: one example per sequence, padded")
    t.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (default: off)")
    t.add_argument("--log-every", type=int, default=1, help="log a metrics record every N steps (default 1)")
    t.add_argument("--metrics", metavar="FILE", type=output_path, help="write one JSON record per logged step to "
                   "FILE (a new file: a new run refuses one holding an earlier run's records; --resume appends)")
    t.add_argument("--tensorboard", metavar="DIR", type=input_path, help="also write the metrics records as "
                   "TensorBoard scalars into DIR (`tensorboard --logdir DIR`; needs the tensorboard extra)")
    t.add_argument("--trace", metavar="FILE", type=output_path, help="write the measured timeline as a Chrome/Perfetto trace")
    t.add_argument("--plot", metavar="FILE", type=output_path, help="draw the last step as measured beside the plan's prediction "
                   "(.png or .svg): device buffers over time above the busy intervals of each stream")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--checkpoint-dir", metavar="DIR", type=input_path, help="where checkpoints go, one step-NNNNNNNN folder each "
                   "(default: the --resume folder when resuming, else ./checkpoints with --checkpoint-every)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps and after the last one (default: off)")
    t.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                   help="keep the last K checkpoints, deleting older ones (default 3)")
    t.add_argument("--resume", metavar="DIR", type=input_path, help="continue from a checkpoint folder, or the latest one in a "
                   "--checkpoint-dir, with the settings it was trained with (its manifest's); flags given override "
                   "them: --steps is the run's total (a larger one extends the run), --lr its new peak")
    t.add_argument("--allow-data-change", action="store_true", help="with --resume: continue although the data "
                   "file's bytes differ from the checkpoint's record of them (a deliberate switch of data)")
    t.add_argument("--dist-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="under torchrun: how long a collective may wait for the other ranks before the run stops "
                   "with an error naming the rank (a rank that dies is named within a tenth of it; default 600)")
    t.add_argument("--sim-threads", type=int, default=None, metavar="N",
                   help="the sim device's compute stream computes with N intra-op threads (default: torch's; the "
                   "host optimizer takes half of them, the copy streams one each: runtime/cpus.py); a probe is "
                   "specific to it")
    t.add_argument("--compile-units", action="store_true",
                   help="run the unit templates through torch.compile (inductor: C++ on the sim device, Triton on "
                   "CUDA): results equal eager to fp32 round-off instead of bit for bit, the first step compiles; "
                   "dense models only (runtime/compiled.py)")
    t.add_argument("--on-nan", choices=("abort", "skip"), default="abort",
                   help="a NaN/inf loss or gradient: abort (default: stop, keep the last checkpoint) or skip "
                   "(apply no update for that step, log it, go on)")
    t.add_argument("--profile", choices=("auto", "off"), help="auto: plan with this machine's cached probe of the "
                   "model's units when one exists (`megatrain probe --model`); off: the --hardware profile as given "
                   "(default: auto with --hardware auto, else off)")
    _settings_flags(t)
    t.set_defaults(func=run_train)

    c = subparsers.add_parser("compile", help="plan a step and write it as a Python step program",
                              description="Plan one optimizer step and render its Program as straight-line "
                              "Python (one statement per instruction), loadable with megatrain.codegen.load.")
    add_common_flags(c)
    c.add_argument("--gpu-mem", metavar="BYTES", help="GPU memory budget (default: the GPU's memory)")
    c.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    c.add_argument("-o", "--out", metavar="FILE", type=output_path, required=True, help="where to write the step program (an existing file is replaced only if it is one)")
    c.set_defaults(func=run_compile)

    e = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model folder (or one "
                              "safetensors file)",
                              description="Write a checkpoint's master weights as a Hugging Face model folder that "
                              "transformers' from_pretrained loads: config.json, generation_config.json, safetensors "
                              "shards with their index, and the tokenizer files of the model the run started from. "
                              "An --out ending in .safetensors writes the weights alone, in one file.")
    e.add_argument("--checkpoint", required=True, metavar="DIR", type=input_path,
                   help="a checkpoint folder, or a --checkpoint-dir (its latest checkpoint)")
    e.add_argument("--out", required=True, metavar="DIR|FILE", type=input_path,
                   help="the model folder to write (replaced whole if it holds an earlier export), or a "
                   ".safetensors file")
    e.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="tensor dtype (default fp32)")
    e.add_argument("--names", choices=("hf", "megatrain"), default="hf",
                   help="hf: Hugging Face names (default); megatrain: this project's unit names, buffers included "
                   "(a .safetensors --out only; the way out for models with no Hugging Face equivalent)")
    e.add_argument("--max-shard-size", metavar="BYTES", default="5GB",
                   help="largest safetensors shard of a model folder (default 5GB, as transformers)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an existing folder megatrain did not export (never a Hugging Face cache snapshot)")
    e.set_defaults(func=run_export)


def _run_file(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("--config needs a run file, e.g. --config run.toml")
    return input_path(text)


class _Once(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            raise ValueError(f"{option_string} is given twice; pass one run file")
        setattr(namespace, self.dest, values)


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that are settings default to None and none is required: a run file may set them, and the
    RunConfig holds their defaults and says which are missing."""
    from megatrain.runtime.config import schema

    names = schema()
    for action in parser._actions:
        if action.dest in names:
            action.default, action.required = None, False


def run_config(args: argparse.Namespace):
    """The RunConfig of `--config FILE` with the flags given laid over it; a problem names the flag."""
    from megatrain.runtime.config import RunConfig, schema
    from megatrain.runtime.runfile import read_run_file

    settings = read_run_file(args.config) if args.config else {}
    settings.update({k: v for k, v in vars(args).items() if k in schema() and v is not None})
    if settings.get("resume"):  # the checkpoint's own settings, under the run file's and the flags'
        from megatrain.runtime.checkpointer import stored_settings

        settings = {**{k.replace("-", "_"): v for k, v in stored_settings(settings["resume"]).items()}, **settings}
        settings.setdefault("allow_schedule_change", True)  # --steps or --lr given on a resume: a change asked for
    cfg = RunConfig.from_settings(settings)
    _need(cfg.checkpoint_dir is None or cfg.checkpoint_every > 0, f"--checkpoint-dir {cfg.checkpoint_dir} without "
          "--checkpoint-every N would write no checkpoint: add --checkpoint-every N (a save every N steps and "
          "after the last)")
    data, val = _data_paths(cfg)
    ckpt_dir = cfg.checkpoint_dir
    if ckpt_dir is None and cfg.checkpoint_every:  # new checkpoints go next to the one resumed from
        from megatrain.runtime.checkpoint import find_checkpoint

        ckpt_dir = str(find_checkpoint(cfg.resume).parent) if cfg.resume else "checkpoints"
    return cfg.replace(data=data, val_data=val, checkpoint_dir=ckpt_dir)


def _data_paths(cfg) -> tuple[str, str | None]:
    if cfg.data:
        _need(cfg.val_data or not cfg.eval_every, f"--eval-every {cfg.eval_every} with --data needs --val-data FILE "
              "(held-out tokens of the same data; `megatrain prepare` writes train.bin and val.bin)")
        return cfg.data, cfg.val_data
    from megatrain.runtime.build import default_corpus

    train_path, val_path = default_corpus(cfg.model)
    return train_path, cfg.val_data or val_path


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_checkpoint_dir(ckpt_dir: str, inputs: dict) -> None:
    """The checkpoint folder receives step-NNNNNNNN folders: it must not be, or hold, what the run reads."""
    folder = Path(ckpt_dir).resolve()
    for flag, path in inputs.items():
        if path and (Path(path).resolve() == folder or folder in Path(path).resolve().parents) and flag != "--resume":
            raise ValueError(f"--checkpoint-dir {ckpt_dir} holds the {flag} input {path}; checkpoints are pruned "
                             "there: choose a folder of their own")


def run_train(args: argparse.Namespace) -> int:
    """`megatrain train`, on one process or as one rank of torchrun's world."""
    from megatrain.runtime.build import device_kind
    from megatrain.runtime.distributed import Communicator, world_from_env

    cfg = run_config(args)
    size = world_from_env()
    _need(all(v is None or v > 0 for v in (cfg.nproc, cfg.nnodes)),
          f"--nproc and --nnodes must be positive integers, got {cfg.nproc} and {cfg.nnodes}")
    want = (cfg.nproc or 1, cfg.nnodes or 1)
    if size <= 1:
        _need(want == (1, 1), f"--nproc {want[0]} --nnodes {want[1]} trains several ranks: launch them with torchrun "
              f"--nnodes {want[1]} --nproc-per-node {want[0] // want[1]} -m megatrain train ... (one process per GPU)")
        device_kind(cfg.device)  # --device cuda without one is refused before any work
        return _run_train(cfg, args.config)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    _need(cfg.nproc in (None, size) and cfg.nnodes in (None, size // max(local, 1)),
          f"--nproc {cfg.nproc} --nnodes {cfg.nnodes} but torchrun started {size} rank(s) on "
          f"{size // max(local, 1)} node(s): drop the flags or make them agree")
    comm = Communicator.from_env(device_kind(cfg.device), timeout_s=cfg.dist_timeout)
    try:
        with comm.guard():  # publishes this rank's failure for the others first
            code = _run_train(cfg, args.config, comm)
            if code > 128:  # stopped by a signal, every rank after the same step: nothing left to wait for
                comm.exit_stopped(code)
            comm.close()
    except BaseException:
        comm.shutdown()
        raise
    return code


def _run_train(cfg, run_file: str | None, comm=None) -> int:
    from megatrain.runtime.distributed import UNVERIFIED_NCCL
    from megatrain.runtime.trainer import Preempted, Trainer

    def say(*a, **kw):  # rank 0 speaks for the world
        if comm is None or comm.rank == 0:
            print(*a, **kw)

    # rank 0 writes the run's outputs (the Trainer: its metrics)
    trace, plot = (cfg.trace, cfg.plot) if comm is None or comm.rank == 0 else (None, None)
    ckpt_dir = cfg.checkpoint_dir
    model = cfg.model if isinstance(cfg.model, str) else None
    hardware = cfg.hardware if isinstance(cfg.hardware, str) else None
    inputs = {"--data": cfg.data, "--val-data": cfg.val_data, "--config": run_file, "--resume": cfg.resume,
              "--model": model if model and Path(model).exists() else None,
              "--hardware": hardware if hardware and Path(hardware).exists() else None}
    check_outputs({"--metrics": cfg.metrics, "--trace": trace, "--plot": plot}, inputs, {"--checkpoint-dir": ckpt_dir})
    _check_metrics_file(cfg.metrics)
    if plot:
        from megatrain.plots import check_plot_path

        check_plot_path(plot)
    if cfg.tensorboard and (comm is None or comm.rank == 0):
        from megatrain.runtime.metrics import tensorboard_writer

        tensorboard_writer(check_only=True)
        writable_dir(cfg.tensorboard, "--tensorboard")
    if ckpt_dir and cfg.checkpoint_every:
        _check_checkpoint_dir(ckpt_dir, inputs)
        writable_dir(ckpt_dir, "--checkpoint-dir")
    say("settings: " + ", ".join(f"{k}={_text(v)}" for k, v in cfg.settings().items()))
    steps = cfg.train.total_steps
    with Trainer(cfg, comm=comm) as trainer:
        p = trainer.plan
        if trainer.profile_note:
            say(trainer.profile_note)
        if trainer.checkpoint_note:  # why checkpoints stop the run, or that their writes outlast their steps
            say(trainer.checkpoint_note if trainer.checkpoint_note.startswith("warning") else
                f"note: {trainer.checkpoint_note}")
        if comm is not None:
            say(f"{p.world}: each streams the model on its {p.program.n_micro_batches} of the step's "
                f"{p.train.grad_accum} micro-batch(es) and holds 1/{comm.size} of the model state (host "
                f"{format_bytes(p.host_bytes)} per rank, {format_bytes(p.host_bytes_per_node)} per node)")
            if comm.backend == "nccl":
                say(f"note: {UNVERIFIED_NCCL}")
        say(f"{p.ir.model}: {p.ir.params_total:,} params streamed through a {trainer.device.kind} device with "
              f"a {format_bytes(cfg.gpu_mem)} budget ({p.n_slots} parameter slot(s); planned device peak "
              f"{format_bytes(trainer.planned_peak_device_bytes)}; host {format_bytes(trainer.host_bytes())} "
              f"under host policy {p.host_policy})"
              + (f"; units tiled in chunks of {p.ir.chunk_tokens:,} tokens" if p.ir.chunk_tokens else "")
              + (f"; {len(p.resident_units)} unit(s) keep their state on the device ({p.resident_units[0]} .. "
                 f"{p.resident_units[-1]})" if p.resident_units else ""))
        if cfg.on_nan == "skip" and cfg.train.clip_norm is None:
            say("--on-nan skip: each step's host optimizer starts once every gradient has landed (a global "
                  "finiteness check), as with --clip-norm")
        if trainer.resumed_from:
            note = (" under a different step program (the results do not depend on it)" if trainer.plan_changed
                    else "")
            say(f"resumed from {trainer.resumed_from} at step {trainer.step} of {steps}{note}")
            for line in _resume_changes(trainer):
                say(line)
            if trainer.step >= steps:
                say(f"nothing left to train: the checkpoint is at step {trainer.step} of --steps {steps}; a larger "
                    "--steps extends the run")
                unwritten = [flag for flag, path in (("--trace", trace), ("--plot", plot)) if path]
                if unwritten:
                    say(f"{' and '.join(unwritten)} not written: they draw the steps this run takes, and it takes "
                        "none; raise --steps")
                return 0
        if trace or plot:
            trainer.engine.start_timeline()
        try:
            records = trainer.run(steps - trainer.step)
        except Preempted as stop:  # each rank says so (under torchrun, its rank named)
            rank = f"rank {comm.rank}: " if comm is not None else ""
            print(f"error: {rank}{stop}", file=sys.stderr, flush=True)
            return stop.exit_code
        spans = trainer.engine.measured_spans() if trace or plot else []
        if trace:
            from megatrain.runtime.timeline import write_measured_trace

            n = write_measured_trace(spans, trace, f"megatrain train: {p.ir.model} on {trainer.device.kind}")
            say(f"wrote {n} spans to {trace}")
        if plot:
            _plot_run(p, spans, plot)
        if trainer.last_checkpoint and trainer.last_checkpoint != trainer.resumed_from:
            say(f"checkpoint: {trainer.last_checkpoint}")
        if trainer.events:
            say(f"{len(trainer.events)} step(s) skipped for a NaN/inf (--on-nan skip): "
                  f"{', '.join(str(e['step']) for e in trainer.events)}")
        last = records[-1] if records else {}
        first = records[0] if records else {}
        if records:
            say(json.dumps({"first_loss": round(first["loss"], 4), "last_loss": round(last["loss"], 4),
                              "val_loss": last.get("val_loss"),
                              # the median: a step's own rate swings with what else the machine does
                              "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in records), 1),
                              "predicted_tokens_per_s": round(p.train.tokens_per_step / p.step_time_s, 1),
                              "time_to_first_step_s": round(trainer.time_to_first_step_s, 3),
                              "predicted_time_to_first_step_s": round(p.time_to_first_step_s, 3),
                              "peak_device_bytes": last["peak_device_bytes"],
                              "planned_peak_device_bytes": last["planned_peak_device_bytes"]}))
    return 0


def _resume_changes(trainer) -> list[str]:
    """One line per setting a resume changed (runtime/checkpointer.py CHANGEABLE): what the schedule does now."""
    from megatrain.runtime.optim import lr_at

    t, step, out = trainer.train, trainer.step, []
    nxt = f"step {step + 1}'s learning rate is {lr_at(t, step):.4g}" if step < t.total_steps else "no step is left"
    if "total_steps" in trainer.checkpoints.changes:
        was = trainer.checkpoints.changes["total_steps"][0]
        out.append(f"{'extended' if t.total_steps > was else 'shortened'}: the run now ends at step {t.total_steps} "
                   f"(was {was}); the {t.schedule} schedule's new length is {t.total_steps} steps, so {nxt}")
    if "lr" in trainer.checkpoints.changes:
        was = trainer.checkpoints.changes["lr"][0]
        out.append(f"learning rate changed: peak {t.lr:g} (was {was:g}) from step {step + 1} on; {nxt}")
    return out


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _plot_run(plan, spans: list[tuple], path: str) -> None:
    from megatrain.planner.series import plan_series
    from megatrain.plots import run_figure, save_figure
    from megatrain.runtime.timeline import measured_series

    measured = measured_series(spans)
    save_figure(run_figure(plan_series(plan), measured), path)
    print(f"wrote plot of step {measured.step} to {path}")


def _is_safetensors(path: Path) -> bool:
    """Whether `path` opens as a safetensors file (tensorfiles.SafetensorsFile checks its header)."""
    from megatrain.runtime.tensorfiles import CheckpointError, SafetensorsFile

    try:
        SafetensorsFile(path).close()
    except CheckpointError:
        return False
    return True


def _check_metrics_file(path: str | None) -> None:
    """--metrics appends to a metrics log (a resumed run continues its own): a file that holds something else is
    refused, untouched."""
    if not path or not Path(path).is_file() or Path(path).stat().st_size == 0:
        return
    with open(path, "rb") as f:
        first = f.readline(1 << 16).strip()
    try:
        ok = isinstance(json.loads(first), dict)
    except (ValueError, RecursionError):
        ok = False
    _need(ok, f"--metrics {path} exists and is not a metrics log (its first line is not a JSON record); the run "
          "would append to it: choose another file")


def _check_step_program(path: str) -> None:
    """compile -o replaces a step program it wrote before (a regeneration) and nothing else: a file that does not
    open with codegen's header (a user's own script, say) is refused, untouched."""
    from megatrain.codegen.emit import HEADER

    if not Path(path).is_file() or Path(path).stat().st_size == 0:
        return
    with open(path, "rb") as f:
        first = f.readline(256)
    _need(first.startswith(HEADER.encode()), f"-o {path} exists and is not a step program megatrain wrote "
          "(its first line is not codegen's header); compile would replace it: choose another file or remove it")


def run_export(args: argparse.Namespace) -> int:
    from megatrain.runtime.export import export_model_dir, export_weights

    if Path(args.out).suffix == ".safetensors":
        check_outputs({"--out": args.out})
        out = check_output_file(args.out)
        _need(not Path(out).is_file() or _is_safetensors(Path(out)), f"--out {args.out} exists and is not a "
              "safetensors file, which an export would replace: choose another path, or remove it first")
        result = export_weights(args.checkpoint, out, dtype=args.dtype, names=args.names)
        print(f"wrote {result['tensors']} tensors ({result['params']:,} parameters, {args.dtype}, "
              f"{format_bytes(result['bytes'])}) of {result['checkpoint']} (step {result['step']}) to {out}")
        return 0
    _need(args.names == "hf", f"--names megatrain writes one safetensors file: pass --out FILE.safetensors, not "
          f"the folder {args.out}")
    writable_dir(str(Path(args.out).parent), "--out", what=f"--out {args.out}")
    result = export_model_dir(args.checkpoint, args.out, dtype=args.dtype,
                              max_shard_bytes=parse_bytes(args.max_shard_size), overwrite=args.overwrite)
    print(f"wrote {result['architecture']} to {args.out}: {result['tensors']} tensors ({result['params']:,} "
          f"parameters, {args.dtype}, {format_bytes(result['bytes'])} in {result['shards']} shard(s)), "
          f"{', '.join(f for f in result['files'] if not f.startswith('model'))}; from {result['checkpoint']} "
          f"(step {result['step']})")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    from megatrain.codegen import emit
    from megatrain.planner import plan

    check_outputs({"-o": args.out}, {"--model": args.model if Path(args.model).exists() else None,
                                     "--hardware": args.hardware if Path(args.hardware).exists() else None})
    _check_step_program(args.out)
    hw = hardware_of(args)
    spec = train_spec(args, args.micro_batch)
    budget = parse_bytes(args.gpu_mem) if args.gpu_mem else hw.gpu_memory_bytes
    result = plan(load_ir(model_config(args), spec, hw), hw, spec, budget, host_policy=args.host_policy,
                  world=world_of(args), resident=args.resident)
    out = Path(args.out)
    write_atomic(out, emit(result), "-o")
    print(f"wrote {len(result.program.instrs)} instructions to {out} (peak {format_bytes(result.peak_gpu_bytes)} "
          f"of {format_bytes(budget)}, predicted {result.step_time_s * 1e3:.1f} ms/step)")
    return 0
