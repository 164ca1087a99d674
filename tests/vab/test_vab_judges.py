"""Judges: scalar-score adapter, reference judges, the external command judge, and judge specs."""

from __future__ import annotations

import pytest
from vab_testing import write_lines

from megatrain.vab.command_judge import CommandJudge
from megatrain.vab.errors import VabError
from megatrain.vab.judges import RandomJudge, ScoreJudge, load_scores
from megatrain.vab.protocol import make_query, run_trial
from megatrain.vab.specs import make_judge
from megatrain.vab.tasks import Task


def _task() -> Task:
    return Task(task_id="t1", domain="d", substyle="s", images=["a.jpg", "b.jpg", "c.jpg"],
                ground_truth_best="B", ground_truth_worst="C")


def _query(protocol="pick_best_and_worst", order=(2, 0, 1)):
    return make_query(_task(), protocol, 1, order)


def test_score_judge_takes_argmax_and_argmin_in_any_order():
    scores = {"a.jpg": 0.5, "b.jpg": 0.9, "c.jpg": 0.1}
    judge = ScoreJudge(lambda task_id, image: scores[image])
    for trial in range(3):
        result = run_trial(_task(), "pick_best_and_worst", trial, judge, "scores")
        assert (result.best, result.worst, result.correct) == ("B", "C", True)


def test_score_judge_ties():
    flat = ScoreJudge(lambda task_id, image: 1.0)
    assert flat(_query()).best == "A"  # first in presented order
    answer = ScoreJudge(lambda task_id, image: 1.0, ties="invalid")(_query())
    assert answer.best is None and "tied" in answer.error


def test_random_judge_is_reproducible_and_distinct():
    query = _query()
    a, b = RandomJudge(3)(query), RandomJudge(3)(query)
    assert a == b and a.best != a.worst
    answers = {RandomJudge(s)(query).best for s in range(40)}
    assert answers == {"A", "B", "C"}
    assert RandomJudge(0)(_query("pick_worst")).best is None


def test_load_scores_checks_labels_and_coverage(tmp_path):
    task = _task()
    good = write_lines(tmp_path / "s.jsonl", [{"task_id": "t1", "scores": {"A": 1, "B": 2, "C": 0}},
                                              {"task_id": "other", "scores": {"A": 1}}])
    assert load_scores(good, [task])[("t1", "b.jpg")] == 2.0
    bad = write_lines(tmp_path / "b.jsonl", [{"task_id": "t1", "scores": {"A": 1, "B": 2}}])
    with pytest.raises(VabError, match=r"b.jsonl:1: field 'scores' has labels \['A', 'B'\]"):
        load_scores(bad, [task])
    with pytest.raises(VabError, match="no scores for 1 task"):
        load_scores(write_lines(tmp_path / "e.jsonl", [{"task_id": "x", "scores": {"A": 1}}]), [task])
    with pytest.raises(VabError, match=r"n.jsonl:1: field 'scores.B'"):
        load_scores(write_lines(tmp_path / "n.jsonl", [{"task_id": "t1", "scores": {"B": "high"}}]), [task])


def test_command_judge_reads_prompt_and_env():
    cmd = 'grep -q "Image A: c.jpg" && echo "thinking..." && echo "BEST: ${VAB_LABELS#A,}" | cut -c1-7'
    answer = CommandJudge(cmd, retry_delays_s=())(_query("pick_best"))
    assert answer.error is None and answer.best == "B"
    assert "thinking" in answer.response


def test_command_judge_retries_a_bad_answer_a_bounded_number_of_times(tmp_path):
    calls = tmp_path / "calls"
    judge = CommandJudge(f"echo x >> {calls}; echo 'BEST: Q'", attempts=3, retry_delays_s=(0,))
    result = run_trial(_task(), "pick_best", 0, judge, "cmd")
    assert calls.read_text().count("x") == 3
    assert not result.valid and not result.correct
    assert "after 3 attempt(s)" in result.error and "Q is not one of the presented labels" in result.error
    assert result.response == "BEST: Q\n"


def test_command_judge_recovers_on_a_later_attempt(tmp_path):
    flag = tmp_path / "flag"
    cmd = f"if [ -e {flag} ]; then echo 'BEST: A'; else touch {flag}; echo 'no idea'; fi"
    answer = CommandJudge(cmd, retry_delays_s=())(_query("pick_best"))
    assert answer.best == "A" and answer.error is None


def test_command_judge_failures_and_timeouts_score_wrong():
    failed = CommandJudge("echo oops >&2; exit 3", attempts=2, retry_delays_s=(0,))(_query())
    assert "exited 3: oops" in failed.error
    slow = CommandJudge("sleep 5", timeout_s=0.2, attempts=1)(_query())
    assert "timed out after 0.2 s" in slow.error


def test_command_that_cannot_run_stops_the_run():
    with pytest.raises(VabError, match="cannot run .exit 127"):
        CommandJudge("definitely-not-a-program-vab")(_query())


def test_judge_specs(tmp_path):
    task = _task()
    assert make_judge("oracle", [task])[1] == "oracle"
    assert make_judge("random", [task])[1] == "random:0"
    assert make_judge("random:7", [task])[1] == "random:7"
    assert make_judge("position:2", [task])[1] == "position:2"
    judge, name = make_judge('cmd:"echo BEST: A"', [task], retry_delays_s=())
    assert name == "cmd:echo BEST: A" and judge(_query("pick_best")).best == "A"
    scores = write_lines(tmp_path / "s.jsonl", [{"task_id": "t1", "scores": {"A": 1, "B": 2, "C": 0}}])
    judge, name = make_judge(f"scores:{scores}", [task])
    assert name.startswith("scores:") and judge(_query()).best == "C"  # B is shown third in order (2, 0, 1)
    for bad, reason in [("gpt", "unknown judge spec"), ("random:x", "not an integer"), ("cmd:", "unknown judge"),
                        ("position:-1", "negative"), ("scores:" + str(tmp_path / "no.jsonl"), "no such file")]:
        with pytest.raises(VabError, match=reason):
            make_judge(bad, [task])


def test_command_judge_reads_its_answer_in_the_query_parse_mode(tmp_path):
    judge = CommandJudge("cat > /dev/null; echo 'Maybe BEST: C at first.'; echo '**BEST: A**'", attempts=1)
    official = run_trial(_task(), "pick_best", 0, judge, "cmd", parse="official")
    assert official.valid and official.best == "C"  # the first match: the early mention, not the bold line
    strict = run_trial(_task(), "pick_best", 0, judge, "cmd", parse="strict")
    assert not strict.valid and "expected the answer to end with BEST: X" in strict.error
    assert not strict.judge_failed and "Maybe BEST: C" in strict.response


def test_command_judge_marks_a_failed_command_as_a_judge_failure():
    failed = run_trial(_task(), "pick_best", 0, CommandJudge("exit 4", attempts=2, retry_delays_s=(0,)), "cmd")
    assert failed.judge_failed and not failed.valid and "exited 4" in failed.error
    unparsed = run_trial(_task(), "pick_best", 0, CommandJudge("echo 'Best: A'", attempts=1), "cmd")
    assert not unparsed.judge_failed and not unparsed.valid and "no `BEST: X` anywhere" in unparsed.error
