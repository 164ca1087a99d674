"""Run a judge over a task set, in memory (`evaluate`) or into a resumable results file (`run_eval`).

Where it sits: the driver of protocol.py; `megatrain vab run` calls run_eval and `megatrain vab report`
reads the file back with load_results. The results file is JSON Lines, one TrialResult per finished trial,
each line flushed and fsynced before the next trial starts. On a rerun:
- complete lines are kept and their (task_id, protocol, trial) keys are skipped;
- a truncated last line (the process was killed mid-write) is cut off and that trial is redone;
- a malformed complete line, a line from another judge, parsed in another parse mode or for a task that
  is not in the task file stops the run with a VabError (the file is not what this run would write).
`retry_failed=True` also redoes trials recorded with an error; the newer line wins when reading.

Try it: `megatrain vab generate --out t.jsonl && megatrain vab run --tasks t.jsonl --judge random
--out r.jsonl` (run it twice: the second run skips every trial).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from pydantic import ValidationError

from megatrain.files import MAX_JSON_DEPTH, json_depth, read_regular

from .base import DEFAULT_PARSE, NUM_TRIALS, PROTOCOLS, ParseMode, Protocol, VabModel
from .errors import VabError
from .jsonl import MAX_JSONL_BYTES, append_line, describe_validation_error
from .judges import Judge
from .protocol import TrialResult, derive_pair, run_trial
from .tasks import Task

Key = tuple[str, str, int]


class RunSummary(VabModel):
    """What one call of run_eval did."""

    path: str
    ran: int
    skipped: int
    invalid: int
    dropped_partial_line: bool


def _split_complete(path: Path, repair: bool) -> tuple[list[str], bool]:
    """Complete lines of `path` and whether a truncated tail was found (cut off the file when `repair`)."""
    if not path.exists():
        return [], False
    data = read_regular(path, MAX_JSONL_BYTES, "a results file written by `megatrain-vab run`", VabError)
    end = data.rfind(b"\n") + 1
    truncated = end < len(data)
    if truncated and repair:
        with path.open("r+b") as fh:
            fh.truncate(end)
    try:
        text = data[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VabError(f"{path}: not UTF-8 ({exc}); pass a results file written by `megatrain vab run`") from None
    return text.splitlines(), truncated


def load_results(path: str | Path, repair: bool = False) -> tuple[list[TrialResult], bool]:
    """(trial results, whether a truncated last line was ignored). Later lines win for a repeated key."""
    path = Path(path)
    lines, truncated = _split_complete(path, repair)
    by_key: dict[Key, TrialResult] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            if json_depth(value) > MAX_JSON_DEPTH:
                raise VabError(f"{path}:{lineno}: nested more than {MAX_JSON_DEPTH} levels deep, which no trial "
                               "result is; pass a file written by `megatrain-vab run`")
            result = TrialResult.model_validate(value)
        except json.JSONDecodeError as exc:
            raise VabError(f"{path}:{lineno}: not valid JSON ({exc.msg}); the file is damaged before its last "
                           "line: delete that line (the trial will be redone) or start a new --out") from None
        except (RecursionError, MemoryError) as exc:
            raise VabError(f"{path}:{lineno}: not valid JSON ({type(exc).__name__}: nested too deeply or too "
                           "large); pass a file written by `megatrain-vab run`") from None
        except ValidationError as exc:
            raise VabError(f"{path}:{lineno}: not a trial result ({describe_validation_error(exc)}); "
                           "pass a file written by `megatrain vab run`") from None
        by_key[result.key] = result
    return list(by_key.values()), truncated


def _check_compatible(path: Path, results: Iterable[TrialResult], tasks: list[Task], judge_name: str,
                      parse: ParseMode) -> None:
    by_id = {t.task_id: t for t in tasks}
    for r in results:
        if r.judge != judge_name:
            raise VabError(f"{path} holds results of judge {r.judge!r}, not {judge_name!r}; "
                           "pass the same --judge to resume or a new --out")
        if r.parse != parse:
            raise VabError(f"{path} holds answers parsed in {r.parse} mode, not {parse}; "
                           f"pass --parse {r.parse} to resume it or a new --out")
        task = by_id.get(r.task_id)
        if task is None:
            raise VabError(f"{path} holds task {r.task_id!r}, which is not in the task file; "
                           "resume with the task file it was run on or pass a new --out")
        if (r.truth_best, r.truth_worst, r.n_images) != (task.ground_truth_best, task.ground_truth_worst, task.size):
            raise VabError(f"{path}: task {r.task_id!r} changed since it was run (ground truth or size); "
                           "pass a new --out")


def _run_task(task: Task, protocols: tuple[Protocol, ...], judge: Judge, judge_name: str, parse: ParseMode,
              done: dict[Key, TrialResult], redo: Callable[[TrialResult], bool],
              emit: Callable[[TrialResult], None]) -> tuple[int, int]:
    """Run the unfinished trials of one task, emitting each; (ran, skipped)."""
    ran = skipped = 0
    for protocol in protocols:
        for trial in range(NUM_TRIALS):
            key = (task.task_id, protocol, trial)
            if key in done and not redo(done[key]):
                skipped += 1
                continue
            source = done.get((task.task_id, "pick_best", trial))
            if protocol == "pick_best_and_worst" and task.size == 2 and source is not None:
                result = derive_pair(task, source)
            else:
                result = run_trial(task, protocol, trial, judge, judge_name, parse)
            done[key] = result
            emit(result)
            ran += 1
    return ran, skipped


def evaluate(tasks: list[Task], judge: Judge, judge_name: str = "judge",
             protocols: tuple[Protocol, ...] = PROTOCOLS, parse: ParseMode = DEFAULT_PARSE) -> list[TrialResult]:
    """All trials of all tasks, in memory (no file, no resume), read and scored in parse mode `parse`."""
    done: dict[Key, TrialResult] = {}
    out: list[TrialResult] = []
    for task in tasks:
        _run_task(task, protocols, judge, judge_name, parse, done, lambda r: False, out.append)
    return out


def run_eval(tasks: list[Task], judge: Judge, judge_name: str, out: str | Path,
             protocols: tuple[Protocol, ...] = PROTOCOLS, retry_failed: bool = False,
             all_tasks: list[Task] | None = None, fsync: bool = True, workers: int = 1,
             progress: Callable[[int, int], None] | None = None, parse: ParseMode = DEFAULT_PARSE) -> RunSummary:
    """Run the trials of `tasks` missing from `out`, appending one durable line per trial.

    `parse` is the parse mode (prompts.py) of every trial; a file written in another mode is refused.

    `all_tasks` (default `tasks`) is the whole task file, for checking results of tasks outside `tasks`.
    `workers` > 1 judges that many tasks at once in threads (the judge must be thread-safe; all judges
    here are); lines then land in completion order, which changes nothing on reading.
    `progress(tasks_done, tasks_total)` is called after each task.
    """
    if workers < 1:
        raise VabError(f"workers is {workers}; use 1 or more")
    path = Path(out)
    existing, truncated = load_results(path)
    _check_compatible(path, existing, all_tasks or tasks, judge_name, parse)
    if truncated:  # NOTE: cut the partial tail only once the file is known to be ours.
        _split_complete(path, repair=True)
    done = {r.key: r for r in existing}
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"ran": 0, "skipped": 0, "invalid": 0, "tasks": 0}
    lock = threading.Lock()

    def redo(r: TrialResult) -> bool:
        return retry_failed and r.error is not None

    with path.open("a", encoding="utf-8") as fh:
        def emit(result: TrialResult) -> None:
            with lock:
                append_line(fh, result, fsync=fsync)
                counts["invalid"] += not result.valid

        def one(task: Task) -> None:
            ran, skipped = _run_task(task, protocols, judge, judge_name, parse, done, redo, emit)
            with lock:
                counts["ran"] += ran
                counts["skipped"] += skipped
                counts["tasks"] += 1
                if progress is not None:
                    progress(counts["tasks"], len(tasks))

        if workers == 1:
            for task in tasks:
                one(task)
        else:
            # NOTE: each task's trials stay in one thread, so a 2-image best+worst trial finds its pick_best.
            with ThreadPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(one, task) for task in tasks]
                try:
                    for future in as_completed(futures):
                        future.result()
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
    return RunSummary(path=str(path), ran=counts["ran"], skipped=counts["skipped"], invalid=counts["invalid"],
                      dropped_partial_line=truncated)
