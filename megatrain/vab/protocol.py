"""The VAB protocol: each task is judged in three orders and every answer is mapped back and scored.

Where it sits: between judges (judges.py) and metrics (metrics.py); runner.py drives it over a task set
and keeps results on disk. For each (task, protocol):
- trial 0 shows the original order; trials 1 and 2 are shuffles from random.Random(task_id), distinct
  from each other and from the original when the set has 3 or more candidates (as the official code);
- the candidates are relabelled A, B, ... in the trial's order; the judge's letters are mapped back to
  the original labels and compared with the ground truth;
- for 2-image sets pick_best_and_worst is not asked: it is derived from the pick_best trial (worst = the
  other candidate), from a recorded pick_best result when there is one;
- the parse mode (base.ParseMode) goes to the judge in the query and decides what a usable answer is:
  official accepts best == worst in pick_best_and_worst, strict refuses it. Each result records its mode.

Try it: `python -c "from megatrain.vab.protocol import trial_orders; print(trial_orders('t1', 4))"`.
"""

from __future__ import annotations

import random

from pydantic import Field

from .base import DEFAULT_PARSE, NUM_TRIALS, ParseMode, Protocol, VabModel, letters
from .judges import Candidate, Judge, JudgeAnswer, JudgeQuery
from .prompts import build_prompt
from .tasks import Task


class TrialResult(VabModel):
    """One judged trial, with everything the report needs (one line of a results file)."""

    task_id: str
    protocol: Protocol
    trial: int = Field(ge=0, lt=NUM_TRIALS)
    judge: str
    domain: str
    substyle: str
    n_images: int
    order: tuple[int, ...] = Field(description="original index of the candidate shown at each position")
    best: str | None = Field(description="answered best, as an original label")
    worst: str | None = Field(description="answered worst, as an original label")
    truth_best: str
    truth_worst: str
    valid: bool = Field(description="the judge gave a usable answer for what the protocol asks")
    correct_best: bool | None = Field(description="None when the protocol does not ask for the best")
    correct_worst: bool | None = Field(description="None when the protocol does not ask for the worst")
    correct: bool = Field(description="everything the protocol asks is right")
    error: str | None = None
    response: str | None = None
    derived_from: Protocol | None = None
    parse: ParseMode = Field(default="strict", description="how the answer was read and how the report scores it "
                             "(docs/VAB.md); lines written before the mode was recorded were strict")
    judge_failed: bool = Field(default=False, description="the judge gave no answer at all (JudgeAnswer.judge_failed)")

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.task_id, self.protocol, self.trial)


def trial_orders(task_id: str, n: int) -> list[tuple[int, ...]]:
    """The three presentation orders of a task: identity, then two shuffles seeded by the task id."""
    orders = [tuple(range(n))]
    rng = random.Random(task_id)
    while len(orders) < NUM_TRIALS:
        order = list(range(n))
        rng.shuffle(order)
        if tuple(order) not in orders or n == 2:
            orders.append(tuple(order))
    return orders


def make_query(task: Task, protocol: Protocol, trial: int, order: tuple[int, ...],
               parse: ParseMode = DEFAULT_PARSE) -> JudgeQuery:
    """The judge's view of one trial: candidates in `order`, relabelled A, B, ..."""
    shown = letters(len(order))
    images = tuple(task.images[i] for i in order)
    return JudgeQuery(task_id=task.task_id, domain=task.domain, substyle=task.substyle, protocol=protocol,
                      trial=trial, candidates=tuple(Candidate(label=la, image=im) for la, im in zip(shown, images)),
                      prompt=build_prompt(protocol, shown, images), parse=parse)


def _check(answer: JudgeAnswer, protocol: Protocol, shown: tuple[str, ...], parse: ParseMode) -> str | None:
    """Why `answer` is unusable for `protocol` under `parse`, or None when it is usable."""
    if answer.error:
        return answer.error
    need_best, need_worst = protocol != "pick_worst", protocol != "pick_best"
    for name, need, value in (("best", need_best, answer.best), ("worst", need_worst, answer.worst)):
        if need and value is None:
            return f"no {name} answered"
        if need and value not in shown:
            return f"{name} {value!r} is not one of the presented labels {', '.join(shown)}"
    if need_best and need_worst and answer.best == answer.worst and parse == "strict":
        return f"best and worst both name {answer.best} (allowed with --parse official)"
    return None


def score_answer(task: Task, protocol: Protocol, trial: int, order: tuple[int, ...], answer: JudgeAnswer,
                 judge: str, derived_from: Protocol | None = None, parse: ParseMode = DEFAULT_PARSE) -> TrialResult:
    """Map a judge's presented letters back to original labels and score them against the ground truth."""
    shown = letters(len(order))
    to_original = {la: task.labels[i] for la, i in zip(shown, order)}
    problem = _check(answer, protocol, shown, parse)
    need_best, need_worst = protocol != "pick_worst", protocol != "pick_best"
    best = to_original[answer.best] if problem is None and need_best else None
    worst = to_original[answer.worst] if problem is None and need_worst else None
    correct_best = (best == task.ground_truth_best) if need_best else None
    correct_worst = (worst == task.ground_truth_worst) if need_worst else None
    correct = problem is None and correct_best is not False and correct_worst is not False
    return TrialResult(task_id=task.task_id, protocol=protocol, trial=trial, judge=judge, domain=task.domain,
                       substyle=task.substyle, n_images=task.size, order=order, best=best, worst=worst,
                       truth_best=task.ground_truth_best, truth_worst=task.ground_truth_worst,
                       valid=problem is None, correct_best=correct_best, correct_worst=correct_worst,
                       correct=correct, error=problem, response=answer.response, derived_from=derived_from,
                       parse=parse, judge_failed=answer.judge_failed)


def derive_pair(task: Task, best_trial: TrialResult) -> TrialResult:
    """pick_best_and_worst of a 2-image task from its pick_best trial (worst is the other candidate), in the
    trial's parse mode."""
    if task.size != 2 or best_trial.protocol != "pick_best":
        raise ValueError("derive_pair needs a pick_best trial of a 2-image task")
    order = best_trial.order
    if best_trial.valid and best_trial.best is not None:
        shown = letters(2)
        best_at = [task.labels[i] for i in order].index(best_trial.best)
        answer = JudgeAnswer(best=shown[best_at], worst=shown[1 - best_at], response=best_trial.response)
    else:
        answer = JudgeAnswer(error=best_trial.error or "no best answered", response=best_trial.response,
                             judge_failed=best_trial.judge_failed)
    return score_answer(task, "pick_best_and_worst", best_trial.trial, order, answer, best_trial.judge,
                        derived_from="pick_best", parse=best_trial.parse)


def run_trial(task: Task, protocol: Protocol, trial: int, judge: Judge, judge_name: str,
              parse: ParseMode = DEFAULT_PARSE) -> TrialResult:
    """Ask `judge` one trial and score it (2-image best+worst is asked as pick_best and derived)."""
    order = trial_orders(task.task_id, task.size)[trial]
    if protocol == "pick_best_and_worst" and task.size == 2:
        return derive_pair(task, run_trial(task, "pick_best", trial, judge, judge_name, parse))
    answer = judge(make_query(task, protocol, trial, order, parse))
    return score_answer(task, protocol, trial, order, answer, judge_name, parse=parse)


def _trials(task: Task, protocol: Protocol, judge: Judge, judge_name: str, parse: ParseMode) -> list[TrialResult]:
    return [run_trial(task, protocol, t, judge, judge_name, parse) for t in range(NUM_TRIALS)]


def pick_best(task: Task, judge: Judge, judge_name: str = "judge",
              parse: ParseMode = DEFAULT_PARSE) -> list[TrialResult]:
    """The three pick_best trials of `task`."""
    return _trials(task, "pick_best", judge, judge_name, parse)


def pick_worst(task: Task, judge: Judge, judge_name: str = "judge",
               parse: ParseMode = DEFAULT_PARSE) -> list[TrialResult]:
    """The three pick_worst trials of `task`."""
    return _trials(task, "pick_worst", judge, judge_name, parse)


def pick_best_and_worst(task: Task, judge: Judge, judge_name: str = "judge",
                        parse: ParseMode = DEFAULT_PARSE) -> list[TrialResult]:
    """The three pick_best_and_worst trials of `task` (derived from pick_best for 2-image sets)."""
    return _trials(task, "pick_best_and_worst", judge, judge_name, parse)
