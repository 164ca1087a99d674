"""Agreement analysis: Kendall tau, McNemar, self-consistency and majority agreement on constructed labels."""

from __future__ import annotations

import math
import random

import pytest
from vab_testing import write_lines

from megatrain.vab.agreement import (
    HumanLabel,
    analyze_agreement,
    compare_protocols,
    compare_runs,
    kendall_tau,
    load_human_labels,
    majority_agrees,
    mcnemar,
    score_choices,
    self_consistency,
)
from megatrain.vab.errors import VabError
from megatrain.vab.judges import OracleJudge, RandomJudge
from megatrain.vab.runner import evaluate
from megatrain.vab.synth import generate_tasks


def test_kendall_tau_known_values():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    # tau-b with a tie in x: pairs (1,2) tied; C=2, D=0 over 3 pairs -> 2 / sqrt(2 * 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))
    assert kendall_tau([1, 1, 1], [1, 2, 3]) is None


def test_mcnemar_exact_and_chi2():
    a = [True] * 10 + [False] * 5
    b = [False] * 10 + [False] * 5
    result = mcnemar(a, b)
    assert (result.only_a, result.only_b, result.n) == (10, 0, 15)
    assert result.p_exact == pytest.approx(2 * 0.5**10)
    assert result.statistic == pytest.approx(81 / 10)
    balanced = mcnemar([True, False, True, False], [False, True, False, True])
    assert balanced.p_exact == 1.0
    assert mcnemar([True], [True]).p_exact == 1.0


def test_score_choices_leave_ties_undecided():
    assert score_choices({"A": 3, "B": 7, "C": 1}) == ("B", "C")
    assert score_choices({"A": 7, "B": 7, "C": 1}) == (None, "C")


def _labels(n_tasks=60, annotators=8, seed=0, score_noise=3.0):
    """Direct picks that agree on the truth; scores that are noisy around it (the paper's finding)."""
    rng = random.Random(seed)
    out = []
    for t in range(n_tasks):
        for a in range(annotators):
            scores = {"A": 8 + rng.gauss(0, score_noise), "B": 5 + rng.gauss(0, score_noise),
                      "C": 2 + rng.gauss(0, score_noise)}
            out.append(HumanLabel(annotator=f"h{a}", task_id=f"t{t}", scores=scores, ranking=("A", "B", "C")))
    return out


def test_self_consistency_and_protocol_comparison():
    exact = _labels(score_noise=0.0)
    sc = self_consistency(exact)
    assert sc.best_agreement == sc.worst_agreement == sc.mean_kendall_tau == 1.0
    noisy = _labels(score_noise=6.0)
    sc = self_consistency(noisy)
    assert 0.3 < sc.best_agreement < 0.95 and sc.mean_kendall_tau < 0.9
    comparison = compare_protocols(noisy, threshold=5, target="best")
    assert comparison.n_tasks == 60 and comparison.direct == 1.0
    assert comparison.scoring < 0.5
    assert comparison.mcnemar.only_b > 30 and comparison.mcnemar.only_a == 0
    assert comparison.mcnemar.p_exact < 0.001
    report = analyze_agreement(noisy)
    assert [c.target for c in report.comparisons] == ["best", "worst", "best_and_worst"]


def test_majority_threshold():
    assert majority_agrees(["A"] * 5 + ["B"] * 3, 5)
    assert not majority_agrees(["A"] * 4 + ["B"] * 4, 5)
    assert not majority_agrees([None] * 8, 5)


def test_human_label_file_errors(tmp_path):
    good = {"annotator": "h1", "task_id": "t1", "scores": {"A": 1, "B": 2}, "best": "B"}
    assert load_human_labels(write_lines(tmp_path / "a.jsonl", [good]))[0].direct_best == "B"
    with pytest.raises(VabError, match=r":2: annotator 'h1' labels task 't1' again"):
        load_human_labels(write_lines(tmp_path / "b.jsonl", [good, good]))
    with pytest.raises(VabError, match=r":1: best 'Z' is not one of the scored"):
        load_human_labels(write_lines(tmp_path / "c.jsonl", [{**good, "best": "Z"}]))
    with pytest.raises(VabError, match=r":1: no labels"):
        load_human_labels(write_lines(tmp_path / "d.jsonl", [{"annotator": "h", "task_id": "t"}]))


def test_compare_runs_pairs_tasks():
    tasks = generate_tasks(60, sizes=(3, 4), seed=8)
    oracle = evaluate(tasks, OracleJudge(tasks), "oracle")
    rand = evaluate(tasks, RandomJudge(0), "random:0")
    result = compare_runs(oracle, rand, "tb1")
    assert result.n == 60 and result.only_b == 0 and result.only_a >= 55
    assert result.p_exact < 1e-10
    with pytest.raises(VabError, match="share no task"):
        compare_runs(oracle, evaluate(generate_tasks(2, prefix="z", seed=1), RandomJudge(0), "r"), "tb1")
