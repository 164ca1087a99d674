"""VAB metrics: pass^3 and single-trial accuracy (ap@1), breakdowns, random baselines, bootstrap intervals.

Where it sits: reads TrialResults (protocol.py / runner.py), produces the VabReport that report.py prints.
Metrics (reference vab.md section 3):
- top1 = pick_best, bot1 = pick_worst, tb1 = best and worst both right in pick_best_and_worst;
  tb1_best / tb1_worst = only the best / only the worst of the joint answer.
- pass3: a task counts only if all 3 trials are recorded, valid and right. ap1: the mean over trial index
  of per-trial accuracy (right trials / counted trials of that index, as `avg_pass_at_1` of the official
  summarize.py). Which trials are counted follows the parse mode of the results (one mode per report):
  - strict: every task with a trial of the protocol is in both denominators with all 3 trials; a missing
    or invalid trial counts as wrong (so ap1 is also the mean over tasks of the share of trials right);
  - official, as summarize.py: a trial whose judge failed (no answer: the official "error" records) and a
    2-image tb1 trial derived from an unusable pick_best (the official code derives none) are left out;
    a task with no trial left is not in the denominators. pass3 needs all 3 trials left, valid and right.
    In ap1 an unparseable (invalid) answer counts as wrong for top1 / bot1, but the tb1 metrics count only
    parsed trials (summarize.py sums over `parsed_answer` records there), so it leaves their denominator.
- random baseline per task with k candidates: 1/k per trial and (1/k)^3 for pass3; tb1 uses 1/(k(k-1))
  (0.5 for k = 2, derived from pick_best); averaged over the actual task mix of the group.
- intervals: percentile bootstrap over tasks (one resample of tasks shared by all metrics of a group);
  each resample recomputes the statistic (the per-trial-index ratios for ap1).

Try it: `python -c "from megatrain.vab.metrics import random_baseline; print(random_baseline([2, 3, 4]))"`.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from pydantic import Field

from .base import DEFAULT_PARSE, NUM_TRIALS, ParseMode, Protocol, VabModel
from .errors import VabError
from .protocol import TrialResult

# metric name -> (protocol, TrialResult field that must be true)
METRICS: dict[str, tuple[Protocol, str]] = {
    "top1": ("pick_best", "correct"),
    "bot1": ("pick_worst", "correct"),
    "tb1": ("pick_best_and_worst", "correct"),
    "tb1_best": ("pick_best_and_worst", "correct_best"),
    "tb1_worst": ("pick_best_and_worst", "correct_worst"),
}


class Estimate(VabModel):
    """A proportion with its bootstrap interval."""

    value: float
    lo: float
    hi: float


class MetricRow(VabModel):
    """One metric over one group of tasks, with the random baseline of the same task mix."""

    n_tasks: int
    pass3: Estimate
    ap1: Estimate
    random_pass3: float
    random_ap1: float


class GroupReport(VabModel):
    n_tasks: int
    metrics: dict[str, MetricRow]


class VabReport(VabModel):
    """Everything `megatrain vab report` prints, as JSON-ready values."""

    judges: list[str]
    parse: ParseMode = Field(description="parse mode of the results: how answers were read and are counted")
    n_tasks: int
    n_trials: int
    n_invalid: int
    n_judge_failed: int = Field(description="trials where the judge gave no answer at all (a subset of n_invalid)")
    incomplete_tasks: int = Field(description="tasks missing a trial of a protocol that was run on them")
    confidence: float
    n_boot: int
    seed: int
    overall: GroupReport
    by_domain: dict[str, GroupReport]
    by_n_images: dict[str, GroupReport]


class TaskOutcome(VabModel):
    """Per-task results of one metric: passed all three trials, and each trial's outcome."""

    task_id: str
    domain: str
    n_images: int
    pass3: bool
    right: tuple[bool | None, ...] = Field(description="per trial index: right, wrong, or None when the parse "
                                           "mode leaves the trial out of the ap1 denominator")

    @property
    def ap1(self) -> float | None:
        """Share of this task's counted trials that are right (None when none is counted)."""
        counted = [r for r in self.right if r is not None]
        return sum(counted) / len(counted) if counted else None


def random_chance(metric: str, k: int) -> float:
    """Single-trial probability that a uniform random judge is right on a k-candidate task."""
    if metric == "tb1":
        return 0.5 if k == 2 else 1.0 / (k * (k - 1))
    return 1.0 / k


def random_baseline(sizes: list[int]) -> dict[str, dict[str, float]]:
    """{metric: {"pass3": ..., "ap1": ...}} of a random judge, averaged over tasks of the given sizes."""
    out = {}
    for metric in METRICS:
        p = np.array([random_chance(metric, k) for k in sizes], dtype=float)
        out[metric] = {"pass3": float(np.mean(p**NUM_TRIALS)), "ap1": float(np.mean(p))}
    return out


def parse_mode(results: list[TrialResult]) -> ParseMode:
    """The one parse mode of `results`; a VabError when they mix modes (their metrics would not add up)."""
    modes = sorted({r.parse for r in results})
    if len(modes) > 1:
        raise VabError(f"the results mix parse modes {' and '.join(modes)}; score each mode on its own "
                       "(one `vab run --parse MODE` per results file)")
    return modes[0] if modes else DEFAULT_PARSE


def _left_out(r: TrialResult) -> bool:
    """Official mode: a trial the official code has no record for, or records as an API error."""
    return r.judge_failed or (r.derived_from is not None and not r.valid)


def task_outcomes(results: list[TrialResult], metric: str) -> dict[str, TaskOutcome]:
    """Per-task outcome of `metric` for every task in its denominator, under the results' parse mode."""
    mode = parse_mode(results)
    protocol, field = METRICS[metric]
    trials: dict[str, dict[int, TrialResult]] = defaultdict(dict)
    for r in results:
        if r.protocol == protocol and not (mode == "official" and _left_out(r)):
            trials[r.task_id][r.trial] = r
    # NOTE: official tb1 metrics count only parsed trials in ap1 (summarize.py `valid`); top1/bot1 count all.
    parsed_only = mode == "official" and protocol == "pick_best_and_worst"
    out = {}
    for task_id, by_trial in trials.items():
        right: list[bool | None] = []
        for t in range(NUM_TRIALS):
            r = by_trial.get(t)
            if r is None or (parsed_only and not r.valid):
                right.append(None if mode == "official" else False)
            else:
                right.append(r.valid and bool(getattr(r, field)))
        first = next(iter(by_trial.values()))
        out[task_id] = TaskOutcome(task_id=task_id, domain=first.domain, n_images=first.n_images,
                                   pass3=all(right), right=tuple(right))
    return out


def _resampled_ratios(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot x columns) ratios sum(w * num) / sum(w * den) over multinomial task weights w (NaN: 0 / 0)."""
    n = num.shape[0]
    rng = np.random.default_rng(seed)
    chunks = []
    for start in range(0, n_boot, 256):  # NOTE: chunks bound memory at 256 x n_tasks weights.
        weights = rng.multinomial(n, np.full(n, 1.0 / n), size=min(256, n_boot - start)).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            chunks.append((weights @ num) / (weights @ den))
    return np.concatenate(chunks)


def _interval(samples: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    alpha = (1.0 - confidence) / 2
    return np.nanquantile(samples, alpha, axis=0), np.nanquantile(samples, 1 - alpha, axis=0)


def bootstrap_ci(values: np.ndarray, n_boot: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of column means of `values` (tasks x metrics; NaN = not measured)."""
    values = np.asarray(values, dtype=float)
    if values.ndim == 1:
        values = values[:, None]
    if values.shape[0] == 0:
        nan = np.full(values.shape[1], np.nan)
        return nan, nan
    mask = ~np.isnan(values)
    return _interval(_resampled_ratios(np.where(mask, values, 0.0), mask.astype(float), n_boot, seed), confidence)


_COLS = 1 + NUM_TRIALS  # per metric: the pass3 ratio, then one accuracy ratio per trial index


def _statistics(ratios: np.ndarray) -> np.ndarray:
    """(..., metrics x _COLS) ratios -> (..., metrics x 2): pass3, and ap1 = the mean over trial indexes
    that count any trial (0 when none does, as summarize.py's `_mean([])`)."""
    ratios = ratios.reshape(*ratios.shape[:-1], -1, _COLS)
    per_trial = ratios[..., 1:]
    counted = ~np.isnan(per_trial)
    n = counted.sum(axis=-1)
    ap1 = np.where(n > 0, np.where(counted, per_trial, 0.0).sum(axis=-1) / np.maximum(n, 1), 0.0)
    return np.stack([ratios[..., 0], ap1], axis=-1).reshape(*ratios.shape[:-2], -1)


def _group(results: list[TrialResult], n_boot: int, confidence: float, seed: int) -> GroupReport:
    sizes = {r.task_id: r.n_images for r in results}
    task_ids = sorted(sizes)
    present = []
    num: list[list[float]] = []
    den: list[list[float]] = []
    for metric in METRICS:
        outcomes = task_outcomes(results, metric)
        if not outcomes:
            continue
        present.append(metric)
        rows = [outcomes.get(t) for t in task_ids]
        num.append([float(o is not None and o.pass3) for o in rows])
        den.append([float(o is not None) for o in rows])
        for i in range(NUM_TRIALS):
            num.append([float(o is not None and bool(o.right[i])) for o in rows])
            den.append([float(o is not None and o.right[i] is not None) for o in rows])
    metrics: dict[str, MetricRow] = {}
    if not present:
        return GroupReport(n_tasks=len(task_ids), metrics=metrics)
    num_t, den_t = np.array(num, dtype=float).T, np.array(den, dtype=float).T
    with np.errstate(invalid="ignore", divide="ignore"):
        point = _statistics(num_t.sum(axis=0) / den_t.sum(axis=0))
    lo, hi = _interval(_statistics(_resampled_ratios(num_t, den_t, n_boot, seed)), confidence)
    for j, metric in enumerate(present):
        measured = den_t[:, j * _COLS] > 0
        base = random_baseline([sizes[t] for t, m in zip(task_ids, measured) if m])[metric]
        est = [Estimate(value=float(point[c]), lo=float(lo[c]), hi=float(hi[c])) for c in (2 * j, 2 * j + 1)]
        metrics[metric] = MetricRow(n_tasks=int(measured.sum()), pass3=est[0], ap1=est[1],
                                    random_pass3=base["pass3"], random_ap1=base["ap1"])
    return GroupReport(n_tasks=len(task_ids), metrics=metrics)


def _incomplete(results: list[TrialResult]) -> int:
    seen: dict[tuple[str, str], set[int]] = defaultdict(set)
    for r in results:
        seen[(r.task_id, r.protocol)].add(r.trial)
    return len({task_id for (task_id, _), trials in seen.items() if len(trials) < NUM_TRIALS})


def build_report(results: list[TrialResult], n_boot: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> VabReport:
    """The full report: overall, by domain and by set size, each with intervals and random baselines.

    The results must share one parse mode (parse_mode); it decides which trials count (module docstring).
    """
    mode = parse_mode(results)
    by_domain: dict[str, list[TrialResult]] = defaultdict(list)
    by_size: dict[int, list[TrialResult]] = defaultdict(list)
    for r in results:
        by_domain[r.domain].append(r)
        by_size[r.n_images].append(r)
    return VabReport(
        judges=sorted({r.judge for r in results}),
        parse=mode,
        n_tasks=len({r.task_id for r in results}),
        n_trials=len(results),
        n_invalid=sum(not r.valid for r in results),
        n_judge_failed=sum(r.judge_failed for r in results),
        incomplete_tasks=_incomplete(results),
        confidence=confidence, n_boot=n_boot, seed=seed,
        overall=_group(results, n_boot, confidence, seed),
        by_domain={d: _group(rs, n_boot, confidence, seed) for d, rs in sorted(by_domain.items())},
        by_n_images={str(k): _group(rs, n_boot, confidence, seed) for k, rs in sorted(by_size.items())},
    )
