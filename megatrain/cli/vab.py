"""`megatrain-vab`: the VAB protocol's own command (generate, run, report, export, agreement), apart from
the training CLI; the protocol is the package megatrain/vab/.

Every leaf parser sets `func(args) -> int`. User errors raise VabError (a ValueError): `main` prints
`error: <message>` and exits 2 (megatrain.cli's convention). It imports nothing of the training stack.
`megatrain vab ...`, its former spelling, still runs it and says so.

    megatrain-vab generate --out tasks.jsonl [--n 90] [--sizes 2,3,4] [--scores scores.jsonl]
    megatrain-vab run --tasks tasks.jsonl --judge SPEC --out results.jsonl [--protocols all] [--parse official]
    megatrain-vab report results.jsonl [--json report.json] [--compare other.jsonl]
    megatrain-vab export --train train.jsonl --eval eval.jsonl --out pairs.jsonl [--no-image-check]
    megatrain-vab agreement labels.jsonl [--threshold 5]

Judge specs: oracle, random[:SEED], position[:INDEX], scores:FILE.jsonl, cmd:COMMAND (docs/VAB.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from megatrain.files import check_outputs, input_path, output_path, write_atomic
from megatrain.vab.agreement import analyze_agreement, compare_runs, load_human_labels
from megatrain.vab.base import DEFAULT_PARSE, PARSE_MODES, parse_protocols
from megatrain.vab.errors import VabError
from megatrain.vab.finetune import export_pairs
from megatrain.vab.jsonl import write_models
from megatrain.vab.metrics import METRICS, build_report, parse_mode
from megatrain.vab.report import print_report, write_report_json
from megatrain.vab.runner import load_results, run_eval
from megatrain.vab.specs import SPEC_HELP, make_judge
from megatrain.vab.synth import generate_tasks, synthetic_scores
from megatrain.vab.tasks import load_tasks, write_tasks


def _ints(text: str, what: str) -> tuple[int, ...]:
    from .app import integer

    try:
        return tuple(integer(x) for x in text.split(",") if x.strip())
    except (ValueError, argparse.ArgumentTypeError):
        raise VabError(f"{what} {text!r} is not a comma list of integers; write e.g. 2,3,4") from None


def _floats(text: str, what: str, most: float = 86_400) -> tuple[float, ...]:
    """A comma list of finite numbers in [0, `most`], in ASCII digits (a delay of inf or 1e308 seconds would
    overflow the sleep that waits it)."""
    from .app import number

    try:
        values = tuple(number(x) for x in text.split(",") if x.strip())
    except (ValueError, argparse.ArgumentTypeError):
        raise VabError(f"{what} {text!r} is not a comma list of numbers; write e.g. 2,5,15") from None
    bad = next((v for v in values if not 0 <= v <= most), None)  # nan fails both comparisons
    if bad is not None:
        raise VabError(f"{what} {text!r}: each value must be a number of seconds in [0, {most:,g}], got {bad}; "
                       "write e.g. 2,5,15")
    return values


def _bounded(**values: int | float | None) -> None:
    """Upper bounds of the numeric flags: past them a value is a typo that would exhaust memory or time."""
    limits = {"n": 10**6, "limit": 10**7, "workers": 256, "attempts": 100, "boot": 10**6, "timeout": 86_400,
              "threshold": 10**6}
    for name, value in values.items():
        if value is not None and not 0 <= value <= limits[name]:
            raise VabError(f"--{name} must be in [0, {limits[name]:,}], got {value}")


def cmd_generate(args: argparse.Namespace) -> int:
    _bounded(n=args.n)
    check_outputs({"--out": args.out, "--scores": args.scores})
    tasks = generate_tasks(args.n, sizes=_ints(args.sizes, "--sizes"), seed=args.seed,
                           best_position=args.best_position, prefix=args.prefix)
    write_tasks(args.out, tasks)
    print(f"wrote {len(tasks)} tasks to {args.out}")
    if args.scores:
        write_models(args.scores, synthetic_scores(tasks, noise=args.noise, seed=args.seed))
        print(f"wrote scores (noise {args.noise:g}) to {args.scores}; try --judge scores:{args.scores}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    _bounded(limit=args.limit, workers=args.workers, attempts=args.attempts, timeout=args.timeout)
    check_outputs({"--out": args.out}, {"--tasks": args.tasks})
    all_tasks = load_tasks(args.tasks, image_root=Path(args.tasks).resolve().parent)
    tasks = all_tasks[: args.limit] if args.limit else all_tasks
    judge, name = make_judge(args.judge, all_tasks, timeout_s=args.timeout, attempts=args.attempts,
                             retry_delays_s=_floats(args.retry_delays, "--retry-delays"))
    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{name}: {done}/{total} tasks", end="" if done < total else "\n", file=sys.stderr, flush=True)

    summary = run_eval(tasks, judge, name, args.out, protocols=parse_protocols(args.protocols),
                       retry_failed=args.retry_failed, all_tasks=all_tasks, workers=args.workers,
                       progress=progress, parse=args.parse)
    note = " (cut a truncated last line and redid that trial)" if summary.dropped_partial_line else ""
    print(f"{name} (parse {args.parse}): ran {summary.ran} trials, skipped {summary.skipped} already in {args.out}, "
          f"{summary.invalid} invalid{note}")
    print(f"next: megatrain vab report {args.out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    _bounded(boot=args.boot)
    check_outputs({"--json": args.json}, {"RESULTS": args.results, "--compare": args.compare})
    results, truncated = load_results(args.results)
    if not results:
        raise VabError(f"{args.results} holds no finished trials; run `megatrain vab run` first")
    report = build_report(results, n_boot=args.boot, confidence=args.confidence, seed=args.seed)
    other = load_results(args.compare)[0] if args.compare else []
    if other and parse_mode(other) != report.parse:  # NOTE: refuse before printing anything.
        raise VabError(f"{args.results} was parsed in {report.parse} mode and {args.compare} in "
                       f"{parse_mode(other)} mode, so their scores are not comparable; rerun one of them with "
                       f"`vab run --parse {report.parse}` into a new --out")
    console = Console()
    print_report(report, console)
    if truncated:
        console.print("note: ignored a truncated last line (an interrupted run); `vab run` will redo it")
    if args.compare:
        for metric in METRICS:
            try:
                m = compare_runs(results, other, metric)
            except VabError:
                continue
            console.print(f"McNemar {metric} pass^3 vs {args.compare}: only this run {m.only_a}, only the other "
                          f"{m.only_b}, n {m.n}, exact p {m.p_exact:.3g}")
    out = args.json or str(Path(args.results).with_suffix("")) + ".report.json"
    write_report_json(report, out)
    console.print(f"wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    check_outputs({"--out": args.out}, {"--train": args.train, "--eval": args.eval})
    # NOTE: image paths resolve against each file's folder, so the leakage check compares real paths.
    train = load_tasks(args.train, image_root=Path(args.train).resolve().parent)
    eval_tasks = load_tasks(args.eval, image_root=Path(args.eval).resolve().parent)
    pairs = export_pairs(train, eval_tasks, protocols=parse_protocols(args.protocols), orders=args.orders,
                         check_images=not args.no_image_check)
    write_models(args.out, pairs)
    print(f"wrote {len(pairs)} prompt/answer pairs to {args.out}")
    return 0


def cmd_agreement(args: argparse.Namespace) -> int:
    _bounded(threshold=args.threshold)
    check_outputs({"--json": args.json}, {"LABELS": args.labels})
    report = analyze_agreement(load_human_labels(args.labels), threshold=args.threshold)
    sc = report.self_consistency

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    tau = "-" if sc.mean_kendall_tau is None else f"{sc.mean_kendall_tau:.3f}"
    print(f"self-consistency: best {pct(sc.best_agreement)} (n={sc.n_best}), worst {pct(sc.worst_agreement)} "
          f"(n={sc.n_worst}), mean Kendall tau {tau} (n={sc.n_ranked})")
    for c in report.comparisons:
        print(f"majority >= {report.threshold} on {c.target}: scoring {pct(c.scoring)}, direct {pct(c.direct)} "
              f"over {c.n_tasks} tasks; McNemar exact p {c.mcnemar.p_exact:.3g}")
    if args.json:
        write_atomic(args.json, report.model_dump_json(indent=2) + "\n", "--json")
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """`megatrain-vab` and its subcommands."""
    from .app import Parser

    vab = Parser(prog="megatrain-vab", description="Visual Aesthetic Benchmark: set-based evaluation of judges "
                 "(docs/VAB.md).")
    vab.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = vab.add_subparsers(dest="vab_command", required=True, parser_class=Parser)

    p = sub.add_parser("generate", help="write a synthetic task set (and optional scores) to try things out")
    p.add_argument("--out", required=True, type=output_path, help="task file to write (JSONL)")
    p.add_argument("--n", type=int, default=90, help="number of tasks (default 90)")
    p.add_argument("--sizes", default="2,3,4", help="set sizes to cycle through (default 2,3,4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--best-position", type=int, default=None, help="pin the best candidate to this position")
    p.add_argument("--prefix", default="", help="prefix for task ids (e.g. train_)")
    p.add_argument("--scores", default=None, type=output_path, help="also write a noisy scores file for the scores: judge")
    p.add_argument("--noise", type=float, default=1.0, help="score noise (default 1.0)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="run a judge over a task set; resumable")
    p.add_argument("--tasks", required=True, type=input_path, help="task file (JSONL)")
    p.add_argument("--judge", required=True, help=f"judge spec: {SPEC_HELP}")
    p.add_argument("--out", required=True, type=output_path, help="results file (JSONL); an existing one is resumed")
    p.add_argument("--protocols", default="all", help="all or a comma list of pick_best,pick_worst,pick_best_and_worst")
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    p.add_argument("--timeout", type=float, default=300.0, help="cmd judge: seconds per call (default 300)")
    p.add_argument("--attempts", type=int, default=3, help="cmd judge: attempts per trial (default 3)")
    p.add_argument("--retry-delays", default="2,5,15", help="cmd judge: seconds between attempts")
    p.add_argument("--retry-failed", action="store_true", help="redo trials recorded with an error")
    p.add_argument("--workers", type=int, default=1, help="tasks judged at once (threads; default 1)")
    p.add_argument("--parse", choices=PARSE_MODES, default=DEFAULT_PARSE,
                   help="how answers are read and scored: official (first BEST:/WORST: anywhere, best == worst "
                        "allowed, as the official evaluator: comparable with published numbers; default) or "
                        "strict (trailing BEST:/WORST: lines only); recorded in every result line")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="print metrics of a results file and write them as JSON")
    p.add_argument("results", type=input_path, help="results file written by `vab run`")
    p.add_argument("--json", default=None, type=output_path, help="report path (default RESULTS.report.json)")
    p.add_argument("--compare", default=None, type=input_path, help="another results file: paired McNemar per metric")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="training split as prompt/answer pairs for fine-tuning a judge")
    p.add_argument("--train", required=True, type=input_path, help="training task file")
    p.add_argument("--eval", required=True, type=input_path, help="evaluation task file (its ids and images are refused)")
    p.add_argument("--out", required=True, type=output_path, help="pairs file to write (JSONL)")
    p.add_argument("--protocols", default="all")
    p.add_argument("--orders", type=int, default=3, help="presentation orders per task (1-3, default 3)")
    p.add_argument("--no-image-check", action="store_true",
                   help="compare task ids and image paths only, not image contents (sha256); for image files "
                        "that are not on disk, such as synthetic tasks")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("agreement", help="human labels: scores vs direct comparison")
    p.add_argument("labels", type=input_path, help="human label file (JSONL)")
    p.add_argument("--threshold", type=int, default=5, help="votes for a majority (default 5, of 8)")
    p.add_argument("--json", default=None, type=output_path, help="also write the analysis as JSON")
    p.set_defaults(func=cmd_agreement)
    return vab


def main(argv: list[str] | None = None) -> int:
    """`megatrain-vab ...`, with the CLI's error convention: a user error prints `error: <message>`, returns 2."""
    from .app import run

    return run(build_parser, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
