"""Judges: anything that looks at one task's candidates in a given order and names the best and/or worst.

Where it sits: protocol.py builds a JudgeQuery per trial (candidates relabelled A, B, ... in the trial's
order, plus the prompt) and calls `judge(query)`; the JudgeAnswer uses the presented letters and
protocol.py maps them back to the original labels. A judge is any callable with that signature; a
judge that raises aborts the run (finished trials stay in the results file).

Adapters and reference judges here:
- ScoreJudge: a scalar scorer; best = argmax, worst = argmin of per-candidate scores;
- OracleJudge: answers the ground truth (finds it by image path);
- RandomJudge: uniform choice, reproducible per (seed, task, protocol, trial);
- PositionJudge: always answers fixed positions, whatever the images.
CommandJudge (an external program) is in command_judge.py; judge specs are parsed in specs.py.

Try it: `python -c "from megatrain.vab.judges import RandomJudge; help(RandomJudge)"`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal
from typing import Protocol as TypingProtocol

from pydantic import Field

from .base import DEFAULT_PARSE, ParseMode, Protocol, VabModel
from .errors import VabError
from .jsonl import read_models
from .tasks import Task


class Candidate(VabModel):
    """One candidate as the judge sees it: its presented letter and its image."""

    label: str
    image: str


class JudgeQuery(VabModel):
    """What a judge receives for one trial: the candidates in the trial's order and the prompt text."""

    task_id: str
    domain: str
    substyle: str
    protocol: Protocol
    trial: int
    candidates: tuple[Candidate, ...]
    prompt: str
    parse: ParseMode = Field(default=DEFAULT_PARSE, description="how a text judge's answer is read (prompts.py)")

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(c.label for c in self.candidates)

    @property
    def images(self) -> tuple[str, ...]:
        return tuple(c.image for c in self.candidates)


class JudgeAnswer(VabModel):
    """A judge's answer in presented letters. `error` set means no usable answer (scored as wrong)."""

    best: str | None = None
    worst: str | None = None
    response: str | None = Field(default=None, description="raw text of a text judge, kept in the results")
    error: str | None = None
    judge_failed: bool = Field(default=False, description="no answer at all: the judge itself failed (a command "
                               "that exited non-zero or timed out on its last attempt), not an unparseable answer")


class Judge(TypingProtocol):
    """Anything callable on a JudgeQuery that returns a JudgeAnswer."""

    def __call__(self, query: JudgeQuery) -> JudgeAnswer: ...


def _wants(protocol: Protocol) -> tuple[bool, bool]:
    return protocol != "pick_worst", protocol != "pick_best"


class OracleJudge:
    """Answers the ground truth of each task (looked up by task id, located by image path)."""

    def __init__(self, tasks: list[Task]):
        self.tasks = {t.task_id: t for t in tasks}

    def __call__(self, query: JudgeQuery) -> JudgeAnswer:
        task = self.tasks.get(query.task_id)
        if task is None:
            raise VabError(f"oracle judge has no task {query.task_id!r}; build it from the same task file")
        where = {c.image: c.label for c in query.candidates}
        want_best, want_worst = _wants(query.protocol)
        return JudgeAnswer(best=where[task.image_of(task.ground_truth_best)] if want_best else None,
                           worst=where[task.image_of(task.ground_truth_worst)] if want_worst else None)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from `parts` that is the same in every process (unlike hash())."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class RandomJudge:
    """Uniform answers: best and worst are a random ordered pair of distinct candidates.

    Each trial draws from its own RNG seeded by (seed, task, protocol, trial), so a resumed run answers
    exactly as an uninterrupted one and the expected scores equal the analytic random baseline.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed

    def __call__(self, query: JudgeQuery) -> JudgeAnswer:
        rng = random.Random(stable_seed(self.seed, query.task_id, query.protocol, query.trial))
        best, worst = rng.sample(query.labels, 2)
        want_best, want_worst = _wants(query.protocol)
        return JudgeAnswer(best=best if want_best else None, worst=worst if want_worst else None)


class PositionJudge:
    """Always answers the candidate at position `index` as best and the last other position as worst.

    The extreme of position bias: its single-trial accuracy can look fine on a set whose best candidate is
    often shown first, while pass^3 exposes it (the answer moves with the shuffles).
    """

    def __init__(self, index: int = 0):
        if index < 0:
            raise VabError(f"position judge index {index} is negative; use 0 for the first position")
        self.index = index

    def __call__(self, query: JudgeQuery) -> JudgeAnswer:
        labels = query.labels
        best_at = min(self.index, len(labels) - 1)
        worst_at = len(labels) - 1 if best_at != len(labels) - 1 else 0
        want_best, want_worst = _wants(query.protocol)
        return JudgeAnswer(best=labels[best_at] if want_best else None,
                           worst=labels[worst_at] if want_worst else None)


Scorer = Callable[[str, str], float]
"""A scalar scorer: (task_id, image path) -> score, higher is better."""


class ScoreJudge:
    """Adapter from a scalar scorer: best = argmax and worst = argmin of the per-candidate scores.

    ties: "first" picks the first tied candidate in presented order (so a tie shows up as position
    sensitivity across the three trials); "invalid" answers nothing, which scores as wrong.
    """

    def __init__(self, scorer: Scorer, ties: Literal["first", "invalid"] = "first"):
        self.scorer = scorer
        self.ties = ties

    def __call__(self, query: JudgeQuery) -> JudgeAnswer:
        scores = [float(self.scorer(query.task_id, c.image)) for c in query.candidates]
        hi, lo = max(scores), min(scores)
        if self.ties == "invalid" and (scores.count(hi) > 1 or scores.count(lo) > 1):
            return JudgeAnswer(error=f"tied scores {scores}; a scalar scorer cannot separate them")
        want_best, want_worst = _wants(query.protocol)
        labels = query.labels
        return JudgeAnswer(best=labels[scores.index(hi)] if want_best else None,
                           worst=labels[scores.index(lo)] if want_worst else None)


class ScoreLine(VabModel):
    """One line of a scores file: the score of each candidate of a task, keyed by its original label."""

    task_id: str = Field(min_length=1)
    scores: dict[str, float]


def load_scores(path: str | Path, tasks: list[Task]) -> dict[tuple[str, str], float]:
    """A scores file as {(task_id, image): score}; every task in `tasks` needs a score for every label."""
    by_id = {t.task_id: t for t in tasks}
    table: dict[tuple[str, str], float] = {}
    covered: set[str] = set()
    fix = 'write lines like {"task_id": "t1", "scores": {"A": 0.7, "B": 0.2}}'
    for lineno, line in read_models(path, ScoreLine, fix):
        task = by_id.get(line.task_id)
        if task is None:
            continue  # NOTE: a scores file may cover more tasks than the ones being run.
        if set(line.scores) != set(task.labels):
            raise VabError(f"{path}:{lineno}: field 'scores' has labels {sorted(line.scores)}, task "
                           f"{task.task_id!r} has {list(task.labels)}; give one score per candidate")
        for label, score in line.scores.items():
            table[(task.task_id, task.image_of(label))] = score
        covered.add(task.task_id)
    missing = [t.task_id for t in tasks if t.task_id not in covered]
    if missing:
        raise VabError(f"{path}: no scores for {len(missing)} task(s) (first: {missing[0]!r}); "
                       "add a line per task or run a task file that matches")
    return table


def table_scorer(table: Mapping[tuple[str, str], float]) -> Scorer:
    """A Scorer that looks scores up in a {(task_id, image): score} table."""
    return lambda task_id, image: table[(task_id, image)]
