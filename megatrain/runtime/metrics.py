"""The metrics log: one JSON record per logged step, written to a file, completed once its step is final.

Where it sits: Trainer.run (trainer.py) opens one per run and hands it each step's record; with
`tensorboard=DIR` every record's numbers also go to TensorBoard as scalars (`scalars_of`) at the record's step. `step_time_s`
covers the step until its state is final, its host optimizer included: the wall time from the step's start
(or, when it overlapped the previous step's host optimizer, from that step's final state) to its own last
host-stream op, so the figures of back-to-back steps add up to the run's wall time and tokens/s is
steady-state throughput; `compute_time_s` is the part until the loss was known. A record is written once its
step is final, at the latest right after the next step's compute (every load of that step waits for an update
of this one), or at a synchronize; records stay in step order.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from megatrain.files import append_open, atomic_open, json_line


def check_new_log(path: str | Path | None, resuming: bool) -> None:
    """A new run's records start a log of their own: a file already holding records is an earlier run's, and
    appending would mix two runs under the same step numbers (a resumed run continues its own log)."""
    if resuming or not path or not Path(path).is_file() or Path(path).stat().st_size == 0:
        return
    raise ValueError(f"--metrics {path} holds an earlier run's records, and a new run does not append to them: "
                     "remove or rename it, pass another --metrics file, or --resume the run that wrote it")


def drop_redone(path: str | Path | None, step: int) -> int:
    """A run resumed at checkpoint `step` redoes the steps after it: the records a killed run wrote for them
    leave its log (else a step would have two records); every other line is kept byte for byte, a torn one
    too (append_open ends it). Replaced atomically; returns how many records left."""
    if not path or not Path(path).is_file():
        return 0
    dropped = 0
    with open(path, "rb") as src, atomic_open(path, "wb", "--metrics") as out:
        for n, raw in enumerate(src, 1):
            try:
                rec = json_line(raw, f"{path}:{n}")
            except ValueError:
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                dropped += 1
            else:
                out.write(raw)
    return dropped


class MetricsLog:
    """Records of the steps of one run(): `add` one per step, `finish` those whose step is final."""

    def __init__(self, engine, tokens_per_step: int, log_every: int, last_final: float | None = None,
                 scalars=None, kept=None):
        self.engine, self.tokens_per_step, self.log_every = engine, tokens_per_step, log_every
        self.kept = kept  # () -> str: what else a run keeps (its checkpoint), said when the log cannot be written
        self.scalars = scalars  # a TensorBoard SummaryWriter (or one like it) the records also go to
        self.last_final = last_final  # when the last completed record's step was final
        self.open: list[dict] = []  # records of steps whose state is not final yet
        self.logged: list[dict] = []  # completed records of logged steps
        self.sink = None

    @contextlib.contextmanager
    def writing(self, path: Path | None):
        """Append completed records to `path` (None: keep them only) while inside."""
        with append_open(path, "--metrics") if path else contextlib.nullcontext() as sink:
            self.sink = sink
            try:
                yield self
            finally:
                self.sink = None
                if self.scalars is not None:
                    self.scalars.flush()

    def write(self, rec: dict) -> None:
        if self.sink:
            try:
                self.sink.write(json.dumps(rec) + "\n")
                self.sink.flush()
            except ValueError as e:  # files.append_open's one line (a full disk): the run's checkpoint too
                raise ValueError(f"{e}; {self.kept()}" if self.kept else str(e)) from None
        if self.scalars is not None:
            for key, value in scalars_of(rec).items():
                self.scalars.add_scalar(key, value, global_step=rec["step"])

    def add(self, rec: dict) -> None:
        """A step's record, holding `_start` (perf_counter at the step's start) and `_index` (its step index)."""
        self.open.append(rec)

    def finish(self, block: bool) -> list[dict]:
        """Complete the records whose step is final (all of them with `block`), in step order; returns them."""
        done = []
        while self.open and self._final(self.open[0], block):
            rec = self.open.pop(0)
            done.append(rec)
            if rec["step"] % self.log_every == 0 or "val_loss" in rec:
                self.logged.append(rec)
                self.write(rec)
        return done

    def _final(self, rec: dict, block: bool) -> bool:
        at = self.engine.final_time(rec["_index"], wait=block)
        if at is None:
            return False
        begin = max(rec.pop("_start"), self.last_final or 0.0)
        self.last_final = at
        rec.pop("_index")
        dt = at - begin
        rec.update(step_time_s=dt, tokens_per_s=self.tokens_per_step / dt)
        return True


def progress_info(rec: dict, planned_peak: int) -> str:
    """The progress bar's line for a completed record."""
    val = f" val {rec['val_loss']:.3f}" if rec.get("val_loss") is not None else ""
    if "moe_experts_per_token" in rec:
        val += (f"  experts/token {rec['moe_experts_per_token']:.2f} zero "
                f"{rec['moe_zero_expert_share']:.0%} max/mean load {rec['moe_load_max_over_mean']:.2f}")
    return (f"loss {rec['loss']:.3f}{val}  {rec['tokens_per_s']:,.0f} tok/s  peak "
            f"{rec['peak_device_bytes'] / 2**20:.1f}/{planned_peak / 2**20:.1f} MiB")


def scalars_of(rec: dict) -> dict[str, float]:
    """A record's numbers as TensorBoard scalars, by the record's own names: every number but the step (the
    x axis); lists (MoE's per-layer loads) and words (a skipped step's reason) stay in the JSONL alone."""
    return {k: float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


def tensorboard_writer(logdir: str | Path | None = None, check_only: bool = False):
    """torch.utils.tensorboard's SummaryWriter on `logdir`; without the tensorboard package, one line naming the
    extra that installs it. `check_only`: just that check (a run says so before anything is allocated)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard (from the megatrain "
                         "checkout: pip install -e '.[tensorboard]'), or drop --tensorboard (the --metrics JSONL holds the same "
                         "records)") from None
    return None if check_only else SummaryWriter(log_dir=str(logdir))
