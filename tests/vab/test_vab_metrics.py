"""Metrics on generated task sets: oracle 100%, random within the CI of its analytic baseline, position gap."""

from __future__ import annotations

import numpy as np
import pytest

from megatrain.vab.agreement import compare_runs
from megatrain.vab.errors import VabError
from megatrain.vab.judges import JudgeAnswer, OracleJudge, PositionJudge, RandomJudge
from megatrain.vab.metrics import METRICS, bootstrap_ci, build_report, random_baseline, task_outcomes
from megatrain.vab.protocol import derive_pair, score_answer
from megatrain.vab.runner import evaluate
from megatrain.vab.synth import generate_tasks


def test_random_baseline_formulas():
    base = random_baseline([3])
    assert base["top1"] == {"pass3": pytest.approx(1 / 27), "ap1": pytest.approx(1 / 3)}
    assert base["tb1"] == {"pass3": pytest.approx(1 / 216), "ap1": pytest.approx(1 / 6)}
    two = random_baseline([2])
    assert two["tb1"] == {"pass3": pytest.approx(0.125), "ap1": pytest.approx(0.5)}
    mix = random_baseline([2, 4])
    assert mix["bot1"]["ap1"] == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert mix["tb1"]["pass3"] == pytest.approx((0.5**3 + (1 / 12) ** 3) / 2)


def test_oracle_scores_100_percent_everywhere():
    tasks = generate_tasks(30, sizes=(2, 3, 4, 5), seed=1)
    report = build_report(evaluate(tasks, OracleJudge(tasks), "oracle"), n_boot=200)
    assert report.n_tasks == 30 and report.n_trials == 30 * 9 and report.n_invalid == 0
    assert set(report.overall.metrics) == set(METRICS)
    groups = [report.overall, *report.by_domain.values(), *report.by_n_images.values()]
    assert set(report.by_n_images) == {"2", "3", "4", "5"}
    assert set(report.by_domain) == {"fine-art", "illustration", "photograph"}
    for group in groups:
        for row in group.metrics.values():
            assert row.pass3.value == row.ap1.value == row.pass3.lo == 1.0


def test_random_judge_lands_in_the_interval_of_the_analytic_baseline():
    tasks = generate_tasks(600, sizes=(2, 3, 4), seed=2)
    report = build_report(evaluate(tasks, RandomJudge(11), "random:11"), n_boot=1000, confidence=0.99, seed=3)
    for name, row in report.overall.metrics.items():
        base = random_baseline([t.size for t in tasks])[name]
        assert row.random_pass3 == pytest.approx(base["pass3"]) and row.random_ap1 == pytest.approx(base["ap1"])
        assert row.pass3.lo <= base["pass3"] <= row.pass3.hi, (name, row)
        assert row.ap1.lo <= base["ap1"] <= row.ap1.hi, (name, row)
    for size, group in report.by_n_images.items():
        tb1 = group.metrics["tb1"]
        assert tb1.ap1.lo <= tb1.random_ap1 <= tb1.ap1.hi, size


def test_position_biased_judge_shows_a_large_gap_between_ap1_and_pass3():
    tasks = generate_tasks(300, sizes=(2, 3, 4), seed=4, best_position=0)  # curators list the best first
    report = build_report(evaluate(tasks, PositionJudge(0), "position:0"), n_boot=200)
    top1 = report.overall.metrics["top1"]
    assert top1.ap1.value > 0.5
    assert top1.pass3.value < 0.15
    assert top1.ap1.value - top1.pass3.value > 0.4
    assert report.by_n_images["3"].metrics["top1"].pass3.value == 0.0  # the two 3-image shuffles differ
    oracle = build_report(evaluate(tasks, OracleJudge(tasks), "oracle"), n_boot=50).overall.metrics["top1"]
    assert oracle.ap1.value - oracle.pass3.value == 0.0


def test_missing_and_invalid_trials_count_as_wrong():
    (task,) = generate_tasks(1, sizes=(3,), seed=5)
    truth = {"best": "A", "worst": "B"}
    right = JudgeAnswer(best=task.ground_truth_best)
    results = [score_answer(task, "pick_best", t, (0, 1, 2), right, "j", parse="strict") for t in (0, 1)]
    outcome = task_outcomes(results, "top1")[task.task_id]
    assert not outcome.pass3 and outcome.ap1 == pytest.approx(2 / 3)
    results.append(score_answer(task, "pick_best", 2, (0, 1, 2), JudgeAnswer(error="parse", **truth), "j",
                                parse="strict"))
    outcome = task_outcomes(results, "top1")[task.task_id]
    assert not outcome.pass3 and outcome.ap1 == pytest.approx(2 / 3)
    report = build_report(results, n_boot=50)
    assert report.n_invalid == 1 and report.incomplete_tasks == 0
    assert build_report(results[:2], n_boot=50).incomplete_tasks == 1


def test_bootstrap_interval_brackets_the_mean_and_skips_missing_values():
    rng = np.random.default_rng(0)
    values = (rng.random((400, 2)) < [0.3, 0.7]).astype(float)
    values[:100, 1] = np.nan
    lo, hi = bootstrap_ci(values, n_boot=500, seed=1)
    means = np.nanmean(values, axis=0)
    assert np.all(lo < means) and np.all(means < hi)
    assert np.all(hi - lo < 0.15)
    lo2, hi2 = bootstrap_ci(values, n_boot=500, seed=1)
    assert np.array_equal(lo, lo2) and np.array_equal(hi, hi2)


def _trials(task, protocol, answers, parse):
    """Scored trials 0, 1, ... of `task` under the identity order, one per answer (None: trial missing)."""
    order = tuple(range(task.size))
    return [score_answer(task, protocol, t, order, a, "j", parse=parse)
            for t, a in enumerate(answers) if a is not None]


def _row(results, metric):
    return build_report(results, n_boot=50).overall.metrics[metric]


def test_official_denominators_follow_the_official_summarize():
    (task,) = generate_tasks(1, sizes=(3,), seed=5)
    right = JudgeAnswer(best=task.ground_truth_best, worst=task.ground_truth_worst)
    unparsed = JudgeAnswer(error="unparseable answer")
    failed = JudgeAnswer(error="command exited 1", judge_failed=True)
    cases = [  # (metric, protocol, answers, strict (pass3, ap1), official (pass3, ap1))
        # a missing trial: wrong in strict; official ap@1 averages the trial indexes that have one
        ("top1", "pick_best", [right, right, None], (0.0, 2 / 3), (0.0, 1.0)),
        # an unparseable answer stays in the top1 denominator as wrong in both modes
        ("top1", "pick_best", [right, right, unparsed], (0.0, 2 / 3), (0.0, 2 / 3)),
        # ... but official tb1 ap@1 counts parsed trials only
        ("tb1", "pick_best_and_worst", [right, right, unparsed], (0.0, 2 / 3), (0.0, 1.0)),
        ("tb1_best", "pick_best_and_worst", [right, unparsed, unparsed], (0.0, 1 / 3), (0.0, 1.0)),
        # a judge failure (the official "error" records) leaves the official ap@1 denominator
        ("bot1", "pick_worst", [failed, right, right], (0.0, 2 / 3), (0.0, 1.0)),
        ("top1", "pick_best", [right, right, right], (1.0, 1.0), (1.0, 1.0)),
    ]
    for metric, protocol, answers, strict, official in cases:
        for mode, (pass3, ap1) in (("strict", strict), ("official", official)):
            row = _row(_trials(task, protocol, answers, mode), metric)
            assert (row.pass3.value, row.ap1.value) == (pytest.approx(pass3), pytest.approx(ap1)), (metric, mode)
            assert row.n_tasks == 1


def test_official_ap1_is_the_mean_over_trial_index_not_over_tasks():
    x, y = generate_tasks(2, sizes=(3,), seed=6)
    failed = JudgeAnswer(error="timed out", judge_failed=True)
    results = (_trials(x, "pick_best", [JudgeAnswer(best=x.ground_truth_best)] * 2 + [failed], "official")
               + _trials(y, "pick_best", [JudgeAnswer(best=y.ground_truth_worst)] * 3, "official"))
    row = _row(results, "top1")
    # trial 0: 1/2, trial 1: 1/2, trial 2: 0/1 (x's failed trial is left out) -> 1/3; the per-task mean is 1/2
    assert row.ap1.value == pytest.approx(1 / 3) and row.pass3.value == 0.0 and row.n_tasks == 2
    assert row.ap1.lo <= row.ap1.value <= row.ap1.hi


def test_official_leaves_out_tasks_with_no_trial_left():
    x, y = generate_tasks(2, sizes=(3,), seed=6)
    failed = JudgeAnswer(error="timed out", judge_failed=True)
    for mode, pass3, n in (("official", 1.0, 1), ("strict", 0.5, 2)):
        results = (_trials(x, "pick_best", [failed] * 3, mode)
                   + _trials(y, "pick_best", [JudgeAnswer(best=y.ground_truth_best)] * 3, mode))
        row = _row(results, "top1")
        assert (row.pass3.value, row.n_tasks) == (pass3, n), mode
    report = build_report(results, n_boot=50)
    assert report.n_judge_failed == 3 and report.n_invalid == 3 and report.parse == "strict"


def test_official_has_no_tb1_trial_derived_from_an_unusable_pick_best():
    (task,) = generate_tasks(1, sizes=(2,), seed=8)
    best = JudgeAnswer(best=task.ground_truth_best)
    for mode, present in (("official", False), ("strict", True)):
        picks = _trials(task, "pick_best", [JudgeAnswer(error="unparseable")] * 3, mode)
        results = picks + [derive_pair(task, p) for p in picks]
        assert ("tb1" in build_report(results, n_boot=20).overall.metrics) == present, mode
        picks = _trials(task, "pick_best", [best, JudgeAnswer(error="unparseable"), best], mode)
        tb1 = _row(picks + [derive_pair(task, p) for p in picks], "tb1")
        assert (tb1.pass3.value, tb1.ap1.value) == (0.0, pytest.approx(1.0 if mode == "official" else 2 / 3))


def test_modes_agree_when_every_trial_is_answered_and_distinct():
    tasks = generate_tasks(60, sizes=(2, 3, 4), seed=9)
    reports = [build_report(evaluate(tasks, RandomJudge(5), "random:5", parse=mode), n_boot=100)
               for mode in ("official", "strict")]
    assert [r.parse for r in reports] == ["official", "strict"]
    assert reports[0].overall == reports[1].overall and reports[0].by_n_images == reports[1].by_n_images


def test_one_report_never_mixes_parse_modes():
    (task,) = generate_tasks(1, sizes=(3,), seed=5)
    right = JudgeAnswer(best=task.ground_truth_best)
    mixed = (_trials(task, "pick_best", [right, right], "official")
             + _trials(task, "pick_best", [None, None, right], "strict"))
    with pytest.raises(VabError, match="the results mix parse modes official and strict"):
        build_report(mixed)
    with pytest.raises(VabError, match="cannot compare a run parsed in official mode with one parsed in strict"):
        compare_runs(mixed[:2], mixed[2:], "top1")
