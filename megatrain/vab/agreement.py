"""Agreement analysis: do scalar scores agree with direct comparison? (reference vab.md section 5)

Where it sits: beside the judge metrics; reads human labels (`megatrain vab agreement LABELS`) and also
compares two judge runs (`megatrain vab report A --compare B`). A human label file has one line per
(annotator, task), with either or both protocols:

    {"annotator": "h3", "task_id": "t7", "scores": {"A": 6, "B": 8, "C": 3},
     "best": "B", "worst": "C", "ranking": ["B", "A", "C"]}

- score-derived choice: argmax / argmin of the scores; a tie gives no choice (it never agrees);
- self-consistency: share of (annotator, task) pairs whose score-derived best equals their direct best
  (and the same for worst), and the mean Kendall tau-b between scores and the direct ranking;
- majority agreement: a task agrees under a protocol when at least `threshold` annotators (5 of 8 in the
  paper) give the same label; computed per protocol on tasks labelled under both;
- McNemar: exact two-sided binomial test on the discordant pairs of paired per-task indicators.
The paper's exact definitions are not verified [recon]; check them before reporting a replication.

Try it: `python -c "from megatrain.vab.agreement import kendall_tau; print(kendall_tau([1, 2, 3], [1, 3, 2]))"`.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import model_validator

from .base import VabModel
from .errors import VabError
from .jsonl import read_models
from .metrics import parse_mode, task_outcomes
from .protocol import TrialResult


class HumanLabel(VabModel):
    """One annotator's labels for one task: scores per candidate and/or a direct choice or ranking."""

    annotator: str
    task_id: str
    scores: dict[str, float] | None = None
    best: str | None = None
    worst: str | None = None
    ranking: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> HumanLabel:
        if self.ranking is not None and len(set(self.ranking)) != len(self.ranking):
            raise ValueError("ranking repeats a label; list each candidate once, best first")
        if self.ranking and self.scores and set(self.ranking) != set(self.scores):
            raise ValueError("ranking and scores name different candidates")
        known = set(self.scores or ()) | set(self.ranking or ())
        for name in ("best", "worst"):
            value = getattr(self, name)
            if known and value is not None and value not in known:
                raise ValueError(f"{name} {value!r} is not one of the scored or ranked candidates {sorted(known)}")
        if self.scores is None and self.direct_best is None and self.direct_worst is None:
            raise ValueError("no labels: give scores, best/worst or a ranking")
        return self

    @property
    def direct_best(self) -> str | None:
        return self.best if self.best is not None else (self.ranking[0] if self.ranking else None)

    @property
    def direct_worst(self) -> str | None:
        return self.worst if self.worst is not None else (self.ranking[-1] if self.ranking else None)


class McNemarResult(VabModel):
    n: int
    only_a: int
    only_b: int
    statistic: float
    p_exact: float
    p_chi2: float


class SelfConsistency(VabModel):
    n_best: int
    best_agreement: float | None
    n_worst: int
    worst_agreement: float | None
    n_ranked: int
    mean_kendall_tau: float | None


class ProtocolComparison(VabModel):
    target: Literal["best", "worst", "best_and_worst"]
    n_tasks: int
    scoring: float | None
    direct: float | None
    mcnemar: McNemarResult


class AgreementReport(VabModel):
    threshold: int
    self_consistency: SelfConsistency
    comparisons: list[ProtocolComparison]


def score_choices(scores: dict[str, float]) -> tuple[str | None, str | None]:
    """(best, worst) = unique argmax and argmin of `scores`; None where the extreme is tied."""
    hi, lo = max(scores.values()), min(scores.values())
    tops = [k for k, v in scores.items() if v == hi]
    bottoms = [k for k, v in scores.items() if v == lo]
    return (tops[0] if len(tops) == 1 else None), (bottoms[0] if len(bottoms) == 1 else None)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall tau-b of two paired sequences (ties allowed); None when either is constant."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau needs paired sequences, got lengths {len(x)} and {len(y)}")
    concordance = tied_x = tied_y = pairs = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            sx = (x[i] > x[j]) - (x[i] < x[j])
            sy = (y[i] > y[j]) - (y[i] < y[j])
            concordance += sx * sy
            tied_x += sx == 0
            tied_y += sy == 0
            pairs += 1
    denom = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return concordance / denom if denom else None


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> McNemarResult:
    """Paired McNemar test: exact binomial p on the discordant pairs, and chi^2 with continuity correction."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar needs paired indicators, got {len(a)} and {len(b)}")
    only_a = sum(1 for u, v in zip(a, b) if u and not v)
    only_b = sum(1 for u, v in zip(a, b) if v and not u)
    m = only_a + only_b
    if m == 0:
        return McNemarResult(n=len(a), only_a=0, only_b=0, statistic=0.0, p_exact=1.0, p_chi2=1.0)
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2**m
    stat = (abs(only_a - only_b) - 1) ** 2 / m
    return McNemarResult(n=len(a), only_a=only_a, only_b=only_b, statistic=stat,
                         p_exact=min(1.0, 2 * tail), p_chi2=math.erfc(math.sqrt(stat / 2)))


def self_consistency(labels: list[HumanLabel]) -> SelfConsistency:
    """Each annotator's score-derived choices and score order against their own direct choices."""
    best_hits, worst_hits, taus = [], [], []
    for lab in labels:
        if not lab.scores:
            continue
        s_best, s_worst = score_choices(lab.scores)
        if lab.direct_best is not None:
            best_hits.append(s_best == lab.direct_best)
        if lab.direct_worst is not None:
            worst_hits.append(s_worst == lab.direct_worst)
        if lab.ranking:
            tau = kendall_tau([lab.scores[k] for k in lab.ranking], [-i for i in range(len(lab.ranking))])
            if tau is not None:
                taus.append(tau)

    def mean(xs: list) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return SelfConsistency(n_best=len(best_hits), best_agreement=mean(best_hits), n_worst=len(worst_hits),
                           worst_agreement=mean(worst_hits), n_ranked=len(taus), mean_kendall_tau=mean(taus))


def _label(lab: HumanLabel, scoring: bool, target: str) -> object | None:
    best, worst = score_choices(lab.scores) if scoring else (lab.direct_best, lab.direct_worst)
    if target == "best":
        return best
    if target == "worst":
        return worst
    return (best, worst) if best is not None and worst is not None else None


def majority_agrees(votes: list[object | None], threshold: int) -> bool:
    """True when at least `threshold` of the votes name the same label (None votes never count)."""
    counts = Counter(v for v in votes if v is not None)
    return bool(counts) and counts.most_common(1)[0][1] >= threshold


def compare_protocols(labels: list[HumanLabel], threshold: int = 5,
                      target: Literal["best", "worst", "best_and_worst"] = "best") -> ProtocolComparison:
    """Majority agreement under scoring vs direct comparison on tasks labelled under both, with McNemar."""
    scoring: dict[str, list] = defaultdict(list)
    direct: dict[str, list] = defaultdict(list)
    for lab in labels:
        if lab.scores:
            scoring[lab.task_id].append(_label(lab, True, target))
        if lab.direct_best is not None or lab.direct_worst is not None:
            direct[lab.task_id].append(_label(lab, False, target))
    tasks = sorted(set(scoring) & set(direct))
    a = [majority_agrees(scoring[t], threshold) for t in tasks]
    b = [majority_agrees(direct[t], threshold) for t in tasks]
    return ProtocolComparison(target=target, n_tasks=len(tasks), scoring=sum(a) / len(a) if a else None,
                              direct=sum(b) / len(b) if b else None, mcnemar=mcnemar(a, b))


def analyze_agreement(labels: list[HumanLabel], threshold: int = 5) -> AgreementReport:
    return AgreementReport(threshold=threshold, self_consistency=self_consistency(labels),
                           comparisons=[compare_protocols(labels, threshold, t)
                                        for t in ("best", "worst", "best_and_worst")])


def load_human_labels(path: str | Path) -> list[HumanLabel]:
    """Human labels from JSONL; one (annotator, task) pair per line."""
    labels: list[HumanLabel] = []
    seen: dict[tuple[str, str], int] = {}
    for lineno, lab in read_models(path, HumanLabel, "see the human label format in docs/VAB.md"):
        key = (lab.annotator, lab.task_id)
        if key in seen:
            raise VabError(f"{path}:{lineno}: annotator {lab.annotator!r} labels task {lab.task_id!r} again "
                           f"(first on line {seen[key]}); keep one line per (annotator, task)")
        seen[key] = lineno
        labels.append(lab)
    if not labels:
        raise VabError(f"{path}: holds no labels; write one (annotator, task) per line")
    return labels


def compare_runs(a: list[TrialResult], b: list[TrialResult], metric: str = "tb1") -> McNemarResult:
    """McNemar on per-task pass^3 of `metric` between two runs, over the tasks both ran.

    Both runs must share one parse mode: pass^3 outcomes of an official and a strict run are not comparable.
    """
    mode_a, mode_b = parse_mode(a), parse_mode(b)
    if mode_a != mode_b:
        raise VabError(f"cannot compare a run parsed in {mode_a} mode with one parsed in {mode_b} mode; "
                       f"rerun one of them with `vab run --parse {mode_a}` (into a new --out)")
    out_a, out_b = task_outcomes(a, metric), task_outcomes(b, metric)
    common = sorted(set(out_a) & set(out_b))
    if not common:
        raise VabError(f"the two result files share no task with {metric} results; compare runs of one task set")
    return mcnemar([out_a[t].pass3 for t in common], [out_b[t].pass3 for t in common])
