"""The protocol: three orders seeded by the task id, answers mapped back to original labels, 2-image derivation."""

from __future__ import annotations

import pytest

from megatrain.vab.judges import JudgeAnswer, OracleJudge, PositionJudge
from megatrain.vab.protocol import (
    derive_pair,
    make_query,
    pick_best,
    pick_best_and_worst,
    pick_worst,
    run_trial,
    score_answer,
    trial_orders,
)
from megatrain.vab.tasks import Task


def _task(n: int = 4, best: str = "C", worst: str = "A", task_id: str = "t1") -> Task:
    return Task(task_id=task_id, domain="photograph", substyle="macro", images=[f"{i}.jpg" for i in range(n)],
                ground_truth_best=best, ground_truth_worst=worst)


def test_orders_identity_first_deterministic_and_distinct():
    for n in (3, 4, 6):
        for task_id in ("a", "b", "photograph_landscape_42"):
            orders = trial_orders(task_id, n)
            assert orders[0] == tuple(range(n))
            assert len(set(orders)) == 3, "shuffles must differ from each other and the original for n >= 3"
            assert all(sorted(o) == list(range(n)) for o in orders)
            assert orders == trial_orders(task_id, n)
    assert trial_orders("a", 5) != trial_orders("b", 5)
    assert all(len(o) == 2 for o in trial_orders("x", 2))


def test_answers_map_back_to_original_labels():
    task = _task()
    for trial, order in enumerate(trial_orders(task.task_id, 4)):
        result = run_trial(task, "pick_best_and_worst", trial, PositionJudge(0), "position:0")
        assert result.order == order
        assert result.best == task.labels[order[0]]  # presented A is original candidate order[0]
        assert result.worst == task.labels[order[-1]]
        assert result.correct == (result.best == "C" and result.worst == "A")


def test_query_shows_shuffled_images_under_fresh_letters():
    task = _task()
    order = trial_orders(task.task_id, 4)[1]
    query = make_query(task, "pick_best", 1, order)
    assert query.labels == ("A", "B", "C", "D")
    assert query.images == tuple(task.images[i] for i in order)
    assert "Image A: " + task.images[order[0]] in query.prompt


def test_oracle_is_right_in_every_trial_of_every_protocol():
    for n in (2, 3, 5):
        task = _task(n, best="B", worst="A")
        oracle = OracleJudge([task])
        for run in (pick_best, pick_worst, pick_best_and_worst):
            trials = run(task, oracle)
            assert [t.trial for t in trials] == [0, 1, 2]
            assert all(t.correct and t.valid for t in trials)


def test_two_image_best_and_worst_is_derived_from_pick_best():
    task = _task(2, best="B", worst="A")
    calls = []

    def judge(query):
        calls.append(query.protocol)
        return JudgeAnswer(best="B")

    result = run_trial(task, "pick_best_and_worst", 0, judge, "j")
    assert calls == ["pick_best"]
    assert result.derived_from == "pick_best" and result.protocol == "pick_best_and_worst"
    assert (result.best, result.worst, result.correct) == ("B", "A", True)
    bad = derive_pair(task, score_answer(task, "pick_best", 1, (1, 0), JudgeAnswer(error="boom"), "j"))
    assert not bad.valid and not bad.correct and bad.error == "boom"


@pytest.mark.parametrize("answer, error", [
    (JudgeAnswer(best="A"), "no worst answered"),
    (JudgeAnswer(best="E", worst="A"), "not one of the presented labels"),
    (JudgeAnswer(best="B", worst="B"), "both name B"),
    (JudgeAnswer(error="judge timed out"), "judge timed out"),
])
def test_unusable_answers_count_as_wrong(answer, error):
    result = score_answer(_task(), "pick_best_and_worst", 0, (0, 1, 2, 3), answer, "j", parse="strict")
    assert not result.valid and not result.correct
    assert result.correct_best is False and result.correct_worst is False
    assert error in result.error


def test_single_protocols_ignore_the_other_side():
    result = score_answer(_task(), "pick_best", 0, (0, 1, 2, 3), JudgeAnswer(best="C", worst="C"), "j")
    assert result.correct and result.worst is None and result.correct_worst is None


def test_official_mode_accepts_best_equal_to_worst_and_scores_it():
    answer = JudgeAnswer(best="C", worst="C")  # presented C is original C under the identity order
    official = score_answer(_task(), "pick_best_and_worst", 0, (0, 1, 2, 3), answer, "j", parse="official")
    assert official.valid and official.error is None and official.parse == "official"
    assert (official.best, official.worst) == ("C", "C")
    assert official.correct_best is True and official.correct_worst is False and not official.correct
    strict = score_answer(_task(), "pick_best_and_worst", 0, (0, 1, 2, 3), answer, "j", parse="strict")
    assert not strict.valid and "allowed with --parse official" in strict.error and strict.parse == "strict"


def test_parse_mode_reaches_the_judge_and_every_result():
    seen = []

    def judge(query):
        seen.append(query.parse)
        return JudgeAnswer(best="B")

    task = _task(2, best="B", worst="A")
    for mode in ("strict", "official"):
        derived = run_trial(task, "pick_best_and_worst", 1, judge, "j", parse=mode)
        assert derived.parse == mode and derived.derived_from == "pick_best"
    assert seen == ["strict", "official"]
    assert all(r.parse == "official" for r in pick_best(_task(), OracleJudge([_task()])))  # the default


def test_judge_failure_is_recorded_apart_from_an_unparseable_answer():
    failed = score_answer(_task(), "pick_best", 0, (0, 1, 2, 3), JudgeAnswer(error="exit 1", judge_failed=True), "j")
    unparsed = score_answer(_task(), "pick_best", 0, (0, 1, 2, 3), JudgeAnswer(error="no BEST"), "j")
    assert failed.judge_failed and not failed.valid
    assert not unparsed.judge_failed and not unparsed.valid
    task = _task(2, best="B", worst="A")
    assert derive_pair(task, score_answer(task, "pick_best", 0, (0, 1), JudgeAnswer(error="exit 1", judge_failed=True),
                                          "j")).judge_failed
