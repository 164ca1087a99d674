"""`megatrain report`: read training metrics (JSONL), print a short summary, or draw the curves with --plot.

Where it sits: reads what `megatrain train --metrics FILE` writes (runtime/trainer.py: one record per logged
step, plus `{"event": "skipped"}` records under --on-nan skip); megatrain/plots.py draws `Run.series`. Try it:
`megatrain report out/demo/metrics.jsonl` or `megatrain report a.jsonl b.jsonl --plot curves.png`.

Reading is tolerant where a live or killed run leaves a file: a torn last line is skipped, events are kept
apart from steps, and a step logged twice (a run resumed from an earlier checkpoint re-logs its steps) keeps
its last record. Anything else that is not a metrics record is refused in one line. Tokens are
step x tokens per step (each record's tokens/s x step time: the step's tokens over its time).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from pydantic import Field

from megatrain.ir.base import IRModel


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# what a step record's fields hold (the loss may be NaN or inf: a step the run skipped or stopped at)
FIELDS = (("step", lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0, "an integer >= 0"),
          ("loss", _number, "a number"),
          ("step_time_s", lambda x: _number(x) and math.isfinite(x) and x > 0, "a number of seconds > 0"),
          ("tokens_per_s", lambda x: _number(x) and math.isfinite(x) and x >= 0, "a number >= 0"))


class Run(IRModel):
    """One metrics file: its step records in step order and its events."""

    label: str
    path: str
    records: tuple[dict, ...]
    events: tuple[dict, ...] = ()
    torn: bool = Field(False, description="the last line was cut off (the run was writing or was killed)")
    relogged: int = Field(0, description="step records of a step logged before (a resume re-logs the steps "
                          "after its checkpoint; a run started afresh on the same file logs from step 1 again)")

    @property
    def tokens_per_step(self) -> int:
        r = self.records[0]
        return round(r["tokens_per_s"] * r["step_time_s"])

    def tokens(self, step: int) -> int:
        return step * self.tokens_per_step

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(tokens, values) of the records that hold a number for `key`."""
        rows = [(self.tokens(r["step"]), r[key]) for r in self.records
                if isinstance(r.get(key), (int, float))]
        return [x for x, _ in rows], [y for _, y in rows]

    def skipped_tokens(self) -> list[int]:
        return [self.tokens(e["step"]) for e in self.events if e.get("event") == "skipped" and "step" in e]


def read_metrics(path: str | Path, label: str | None = None) -> Run:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read metrics file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file; is this a `megatrain train --metrics` file?") from None
    steps: dict[int, dict] = {}
    events: list[dict] = []
    torn, relogged = False, 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if n == len(lines) and n > 1:
                torn = True
                continue
            raise ValueError(f"{path} line {n}: not JSON; is this a `megatrain train --metrics` file?"
                             ) from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path} line {n}: expected a JSON object, got {type(rec).__name__}")
        if "event" in rec:
            events.append(rec)
            continue
        missing = [k for k in ("step", "loss", "step_time_s", "tokens_per_s") if k not in rec]
        if missing:
            raise ValueError(f"{path} line {n}: a step record needs {', '.join(missing)}; is this a "
                             "`megatrain train --metrics` file?")
        for key, ok, what in FIELDS:
            if not ok(rec[key]):
                raise ValueError(f"{path} line {n}: {key} must be {what}, got {json.dumps(rec[key])[:40]}; is "
                                 "this a `megatrain train --metrics` file?")
        relogged += rec["step"] in steps
        steps[rec["step"]] = rec
    if not steps:
        raise ValueError(f"{path}: no step records (train with --metrics {path} to write some)")
    return Run(label=label or p.stem, path=str(path), records=tuple(steps[k] for k in sorted(steps)),
               events=tuple(events), torn=torn, relogged=relogged)


def labels(paths: list[str]) -> list[str]:
    """File stems, with as many parent folders as it takes to tell them apart (`a/metrics`, `b/metrics`)."""
    parts = [Path(p).with_suffix("").parts for p in paths]
    for depth in range(1, max(len(x) for x in parts) + 1):
        names = ["/".join(x[-depth:]) for x in parts]
        if len(set(names)) == len(names):
            return names
    return [f"{n} ({i + 1})" for i, n in enumerate(names)]


def read_runs(paths: list[str]) -> list[Run]:
    return [read_metrics(p, label) for p, label in zip(paths, labels(paths))]


def summary_lines(run: Run) -> list[str]:
    first, last = run.records[0], run.records[-1]
    times = [r["step_time_s"] for r in run.records]
    tps = [r["tokens_per_s"] for r in run.records]
    out = [f"{run.label}: steps {first['step']}-{last['step']} ({len(run.records)} records, "
           f"{run.tokens(last['step']):,} tokens), loss {first['loss']:.4g} -> {last['loss']:.4g}"]
    val = run.series("val_loss")[1]
    if val:
        out[0] += f", val loss {val[-1]:.4g}"
    line = f"  {statistics.median(tps):,.0f} tokens/s median; step {statistics.median(times):.4g} s median"
    if isinstance(last.get("predicted_step_time_s"), (int, float)):
        line += f" (predicted {last['predicted_step_time_s']:.4g} s)"
    if "peak_device_bytes" in last and "planned_peak_device_bytes" in last:
        from megatrain.planner.bytesize import format_bytes

        line += (f"; device peak {format_bytes(max(r.get('peak_device_bytes', 0) for r in run.records))} "
                 f"(planned {format_bytes(last['planned_peak_device_bytes'])})")
        for measured, planned, what in (("peak_reserved_bytes", "planned_peak_reserved_bytes", "reserved"),
                                        ("device_used_bytes", "planned_peak_gpu_bytes", "GPU in use")):
            if measured in last and planned in last:  # cuda's: the allocator's hold and the whole GPU's use
                line += (f", {what} {format_bytes(max(r.get(measured, 0) for r in run.records))} "
                         f"(planned {format_bytes(last[planned])})")
    out.append(line)
    grad = run.series("grad_norm")[1]
    if grad:
        out.append(f"  grad norm {grad[0]:.4g} -> {grad[-1]:.4g}")
    moe = run.series("moe_load_max_over_mean")[1]
    if moe:
        out.append(f"  MoE max/mean expert load {moe[-1]:.3g} at the last step")
    skipped = run.skipped_tokens()
    if skipped:
        out.append(f"  {len(skipped)} step(s) skipped for a NaN/inf: "
                   + ", ".join(str(e["step"]) for e in run.events if e.get("event") == "skipped"))
    if run.relogged:
        out.append(f"  ({run.relogged} step record(s) repeat a step logged earlier in the file, by a resume or a "
                   "new run on the same file: the last record of each step is shown)")
    if run.torn:
        out.append("  (the last line was cut off and is skipped)")
    return out
