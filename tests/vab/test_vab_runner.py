"""Resumable runs: a killed run resumes without redoing or losing trials and ends equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from megatrain.vab.errors import VabError
from megatrain.vab.judges import JudgeAnswer, RandomJudge
from megatrain.vab.runner import evaluate, load_results, run_eval

TOTAL = 12 * 9  # tasks x (3 protocols x 3 trials)


class Counting:
    """Wraps a judge; counts calls; optionally raises or SIGKILLs its own process at call `stop_at`."""

    def __init__(self, judge, stop_at: int | None = None, how: str = "raise"):
        self.judge, self.stop_at, self.how, self.calls = judge, stop_at, how, 0
        self.lock = threading.Lock()

    def __call__(self, query):
        with self.lock:
            if self.stop_at is not None and self.calls >= self.stop_at:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("judge crashed")
            self.calls += 1
        return self.judge(query)


def _sorted(results):
    return sorted(results, key=lambda r: r.key)


def _lines(path):
    return path.read_text().splitlines()


def test_resume_after_a_crash_redoes_nothing_and_loses_nothing(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError, match="judge crashed"):
        run_eval(small_tasks, Counting(RandomJudge(5), stop_at=40), "random:5", out, fsync=False)
    kept = len(_lines(out))
    assert 40 <= kept < TOTAL  # every answered trial was written (derived 2-image trials need no call)
    again = Counting(RandomJudge(5))
    summary = run_eval(small_tasks, again, "random:5", out, fsync=False)
    assert summary.skipped == kept and summary.ran == TOTAL - kept
    assert again.calls <= summary.ran
    resumed, _ = load_results(out)
    assert len(_lines(out)) == len(resumed) == TOTAL  # no key written twice
    assert _sorted(resumed) == _sorted(evaluate(small_tasks, RandomJudge(5), "random:5"))
    third = run_eval(small_tasks, Counting(RandomJudge(5)), "random:5", out, fsync=False)
    assert (third.ran, third.skipped) == (0, TOTAL)


def test_sigkill_mid_run_and_a_truncated_last_line_resume_exactly(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    pid = os.fork()
    if pid == 0:  # child: run until the judge SIGKILLs the process
        try:
            run_eval(small_tasks, Counting(RandomJudge(9), stop_at=33, how="kill"), "random:9", out)
        finally:
            os._exit(3)  # only reached if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    complete = _lines(out)
    assert len(complete) >= 33
    with out.open("a") as fh:  # a kill during a write leaves half a line
        fh.write('{"task_id": "fine-art_portrait_0003", "protocol": "pick_wo')
    partial, truncated = load_results(out)
    assert truncated and len(partial) == len(complete)
    summary = run_eval(small_tasks, RandomJudge(9), "random:9", out, fsync=False)
    assert summary.dropped_partial_line and summary.skipped == len(complete)
    assert _lines(out)[: len(complete)] == complete  # complete lines kept byte for byte
    final, truncated = load_results(out)
    assert not truncated
    assert _sorted(final) == _sorted(evaluate(small_tasks, RandomJudge(9), "random:9"))


def test_resume_refuses_another_judge_or_task_file(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    run_eval(small_tasks[:2], RandomJudge(0), "random:0", out, fsync=False)
    with pytest.raises(VabError, match="holds results of judge 'random:0', not 'random:1'"):
        run_eval(small_tasks, RandomJudge(1), "random:1", out)
    with pytest.raises(VabError, match="which is not in the task file"):
        run_eval(small_tasks[2:], RandomJudge(0), "random:0", out)


def test_damaged_middle_line_is_an_error_not_silently_dropped(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    run_eval(small_tasks[:1], RandomJudge(0), "random:0", out, fsync=False)
    lines = _lines(out)
    lines[3] = lines[3][:20]
    out.write_text("\n".join(lines) + "\n")
    with pytest.raises(VabError, match=r"r.jsonl:4: not valid JSON"):
        run_eval(small_tasks, RandomJudge(0), "random:0", out)
    lines[3] = json.dumps({"task_id": "x"})
    out.write_text("\n".join(lines) + "\n")
    with pytest.raises(VabError, match=r"r.jsonl:4: not a trial result"):
        load_results(out)


def test_retry_failed_redoes_only_errored_trials(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    tasks = [t for t in small_tasks if t.size == 3][:2]
    flaky_calls = []

    def flaky(query):
        flaky_calls.append(query.trial)
        if query.trial == 1:
            return JudgeAnswer(error="api down")
        return RandomJudge(2)(query)

    first = run_eval(tasks, flaky, "j", out, fsync=False)
    assert first.invalid == 2 * 3 and first.ran == 18
    rerun = run_eval(tasks, RandomJudge(2), "j", out, fsync=False, retry_failed=True)
    assert rerun.ran == 6 and rerun.skipped == 12 and rerun.invalid == 0
    results, _ = load_results(out)
    assert len(results) == 18 and all(r.valid for r in results)
    assert _sorted(results) == _sorted(evaluate(tasks, RandomJudge(2), "j"))


def test_parallel_workers_write_the_same_results_and_resume(tmp_path, small_tasks):
    out = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError, match="judge crashed"):
        run_eval(small_tasks, Counting(RandomJudge(4), stop_at=30), "random:4", out, fsync=False, workers=4)
    kept = len(_lines(out))
    seen = []
    summary = run_eval(small_tasks, RandomJudge(4), "random:4", out, fsync=False, workers=4,
                       progress=lambda done, total: seen.append((done, total)))
    assert summary.skipped == kept and summary.ran + kept == TOTAL
    assert seen[-1] == (12, 12) and len(seen) == 12
    results, _ = load_results(out)
    assert len(_lines(out)) == TOTAL
    assert _sorted(results) == _sorted(evaluate(small_tasks, RandomJudge(4), "random:4"))
