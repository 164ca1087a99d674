"""Resumable study runs, shared by study_depth_mixing.py and study_moe.py (issue 18).

A study is a list of runs, each named by a key (variant, seed, steps, ...). Finished runs are one JSON
record a line in the study's results file: a run whose key is already there is skipped, so a study can be
completed in pieces (rerun the same command). A run in flight keeps a Trainer checkpoint and its figures
so far (validation points, per-step records) in its work folder after every validation point, and resumes
from them, bit for bit (the Trainer's resume contract), when the command is run again.

Every run trains with megatrain's streamed runtime (Trainer, sim device, the whole model on device) on the
built-in corpus (byte tokens); the seed fixes init (each tensor from (seed, name): the parameters variants
share start equal) and the data order (Batcher: windows from (seed, step)). Validation: `val_batches` fixed
batches of the validation split at each point of `evals` (the last one is the run's end).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import stats

from megatrain.models import ModelConfig
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

BUDGET = 256 * 2**20  # the whole model fits: the runs measure the model, not streaming


def done(results: Path) -> dict[str, dict]:
    """The finished runs of a results file, by key."""
    if not results.exists():
        return {}
    out = {}
    for line in results.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["key"]] = rec
    return out


def train(key: str, config: ModelConfig, spec: TrainSpec, evals: list[int], data, work: Path, val_batches: int,
          keep: Callable[[dict], dict] | None = None, budget: int = BUDGET) -> dict:
    """Train `spec.total_steps` steps with validation at each step of `evals` (ascending, the last =
    total_steps); resumes from `work` when a previous attempt left a checkpoint there. Returns the run's
    record: key, params, val (step -> loss), per_step (the step records reduced by `keep`), wall seconds of
    training and validation (this attempt and earlier ones), and the median tokens/s. `budget`: the sim
    device's pool; the plan it yields does not change the numbers (streamed = eager bit for bit)."""
    steps = spec.total_steps
    assert evals and evals[-1] == steps and evals == sorted(evals), evals
    ckpt, progress_path = work / "ckpt", work / "progress.json"
    progress = json.loads(progress_path.read_text()) if progress_path.exists() else None
    if progress is None and work.exists():
        shutil.rmtree(work)  # a start that never reached its first validation point
    work.mkdir(parents=True, exist_ok=True)
    progress = progress or {"key": key, "val": {}, "steps": [], "seconds": 0.0, "attempts": 0}
    progress["attempts"] += 1
    # the checkpoint of the last recorded point (a later one may exist if a kill came before its figures)
    last = max((int(s) for s in progress["val"]), default=0)
    resume = ckpt / f"step-{last:08d}" if last else None
    with Trainer(RunConfig(model=config, train=spec, gpu_mem=budget, device="sim", data=data[0], val_data=data[1],
                           checkpoint_dir=ckpt, keep_checkpoints=2, resume=resume)) as t:
        for point in evals:
            if point <= t.step:
                continue
            t0 = time.perf_counter()
            records = t.run(point - t.step, progress=False, handle_signals=False)
            val = t.validation_loss(val_batches)
            progress["seconds"] += time.perf_counter() - t0
            if point < steps:
                t.save_checkpoint()
            progress["val"][str(point)] = val
            progress["steps"] += [{"step": r["step"], "loss": round(r["loss"], 5), "tokens_per_s": round(r["tokens_per_s"]),
                                   **(keep(r) if keep else {})} for r in records]
            tmp = progress_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(progress))
            tmp.replace(progress_path)
            if not math.isfinite(val):
                break
    return {"key": key, "params": config.n_params(), "val": progress["val"],
            "val_loss": progress["val"][str(evals[-1])], "seconds": round(progress["seconds"], 1),
            "attempts": progress["attempts"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in progress["steps"][1:] or progress["steps"]),
            "per_step": progress["steps"]}


def finish(results: Path, record: dict, work: Path) -> None:
    """Append a finished run to the results file and drop its work folder."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(json.dumps(record) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def paired(diffs: list[float], sd_floor: float = 0.0, df_floor: float | None = None) -> tuple[float, float, float]:
    """(mean, low, high) of a paired 95% t interval of per-seed differences (low = high = mean for one), the t
    quantile exact for any number of seeds and the sd at least a noise arm's `sd_floor` (stats.paired)."""
    iv = stats.paired(diffs, 0.95, sd_floor, df_floor)
    return iv.mean, iv.low, iv.high
