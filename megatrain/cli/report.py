"""`megatrain report`: summarize `megatrain train --metrics` files, or draw their curves
(megatrain/runtime/report.py reads them)."""

from __future__ import annotations

import argparse

from megatrain.files import check_outputs, input_path, output_path
from megatrain.runtime.report import read_runs, summary_lines


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser("report", help="summarize training metrics files, or draw their curves (--plot)",
                              description="Read `megatrain train --metrics` files (JSONL) and print a "
                              "summary per file; with --plot, draw loss, validation loss, tokens/s, measured "
                              "against predicted step time and device peak, grad norm and MoE load balance "
                              "against tokens, one color per file (labelled by file name).")
    r.add_argument("files", nargs="+", metavar="FILE", type=input_path, help="metrics JSONL files")
    r.add_argument("--plot", metavar="FILE", type=output_path, help="draw the curves to FILE (.png or .svg)")
    r.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    check_outputs({"--plot": args.plot}, {f"FILE {i + 1}": f for i, f in enumerate(args.files)})
    if args.plot:
        from megatrain.plots import check_plot_path

        check_plot_path(args.plot)
    runs = read_runs(args.files)
    for run in runs:
        print("\n".join(summary_lines(run)))
    if args.plot:
        from megatrain.plots import curves_figure, save_figure

        save_figure(curves_figure(runs), args.plot)
        print(f"wrote plot to {args.plot}")
    return 0
