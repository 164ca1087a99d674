"""Printing and saving a VabReport: rich tables for the terminal, JSON for the record.

Where it sits: the last step of `megatrain vab report RESULTS` (cli.py), after metrics.build_report.
The title names the parse mode of the results (official or strict): the numbers of one mode are not
comparable with the other's. Tables: overall (pass^3 and ap@1 with intervals, the ap@1 - pass^3 gap
that measures position sensitivity, the random baseline), then tb1 / top1 / bot1 pass^3 by domain and by set size. Metric
names as in metrics.py: top1 (best), bot1 (worst), tb1 (both, joint prompt), tb1_best, tb1_worst.

Try it: `megatrain vab report r.jsonl` after `megatrain vab run ... --out r.jsonl`.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatrain.files import write_atomic

from .metrics import Estimate, GroupReport, VabReport

PARSE_NOTES = {
    "official": "first BEST:/WORST: anywhere, counted as the official evaluator (comparable with published numbers)",
    "strict": "trailing BEST:/WORST: lines only, every trial counted (not comparable with published numbers)",
}
INVALID_NOTES = {
    "official": "scored wrong; tb1 ap@1 leaves them out, as the official summarize.py",
    "strict": "scored wrong",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _est(e: Estimate) -> str:
    return f"{_pct(e.value)} [{_pct(e.lo)},{_pct(e.hi)}]"


def overall_table(report: VabReport) -> Table:
    conf = f"{100 * report.confidence:g}% CI"
    table = Table(title=f"VAB: {', '.join(report.judges)} on {report.n_tasks} tasks, parse {report.parse} "
                        f"(percent [{conf}])")
    for col in ("metric", "pass^3", "ap@1", "gap", "random p^3/ap@1", "n"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, row in report.overall.metrics.items():
        table.add_row(name, _est(row.pass3), _est(row.ap1), _pct(row.ap1.value - row.pass3.value),
                      f"{_pct(row.random_pass3)} / {_pct(row.random_ap1)}", str(row.n_tasks))
    return table


def breakdown_table(title: str, groups: dict[str, GroupReport], metrics: tuple[str, ...]) -> Table:
    table = Table(title=f"pass^3 by {title} (percent; random in parentheses)")
    table.add_column(title)
    table.add_column("tasks", justify="right")
    for m in metrics:
        table.add_column(m, justify="right")
    for key, group in groups.items():
        cells = []
        for m in metrics:
            row = group.metrics.get(m)
            cells.append("-" if row is None else f"{_pct(row.pass3.value)} ({_pct(row.random_pass3)})")
        table.add_row(key, str(group.n_tasks), *cells)
    return table


def print_report(report: VabReport, console: Console | None = None) -> None:
    console = console or Console()
    console.print(overall_table(report))
    shown = tuple(m for m in ("tb1", "top1", "bot1") if m in report.overall.metrics)
    console.print(breakdown_table("domain", report.by_domain, shown))
    console.print(breakdown_table("n_images", report.by_n_images, shown))
    notes = [f"parse mode {report.parse}: {PARSE_NOTES[report.parse]}",
             f"{report.n_trials} trials, {report.n_invalid} invalid answers ({INVALID_NOTES[report.parse]})"]
    if report.n_judge_failed:
        left = "left out of ap@1, and of pass^3 where no trial of a task is left" if report.parse == "official" \
            else "scored wrong"
        notes.append(f"{report.n_judge_failed} of them judge failures ({left}); `vab run --retry-failed` redoes them")
    if report.incomplete_tasks:
        notes.append(f"{report.incomplete_tasks} task(s) miss trials (scored wrong); rerun `vab run` to finish")
    console.print("; ".join(notes))


def write_report_json(report: VabReport, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, report.model_dump_json(indent=2) + "\n", "--json")
