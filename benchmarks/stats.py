"""The studies' decision arithmetic in one place (issue 43): exact Student t quantiles, paired intervals, Holm's
correction, seed-count rules that keep the n they were written for, and intervals that respect a noise floor.

Why a module of its own: the decision rules of study_moe.py, study_depth_mixing.py and quality_host_policy.py
were each written before their data; the code that applies them must not change what they say when a study
grows (more seeds, more comparisons). Every function here is tested against published tables
(tests/test_study_stats.py), with no scipy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from fractions import Fraction


# -- Student t, exactly -----------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz); it converges fast
    for x < (a + 1) / (a + b + 2), which `betainc` arranges by symmetry."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom (any df > 0, not only integers)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if t == 0:
        return 0.5
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p: bisection on the exact CDF to the float's resolution (the CDF is monotone, so
    this cannot land on a wrong root)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def t_two_sided(level: float, df: float) -> float:
    """The critical value of a two-sided `level` interval (0.95: t_{0.975, df}; df 30 gives 2.042)."""
    return t_quantile(0.5 + level / 2.0, df)


# -- intervals --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    level: float
    p: float | None = None  # the two-sided p-value of mean = 0 (None with one value)

    def excludes_zero(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def fmt(self, digits: int = 4, pct: bool = False) -> str:
        if pct:
            return f"{self.mean:+.{digits}%} [{self.low:+.{digits}%}, {self.high:+.{digits}%}]"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]" if self.n > 1 else \
            f"{self.mean:+.{digits}f}"


def paired(diffs: list[float], level: float = 0.95, sd_floor: float = 0.0, df_floor: float | None = None
           ) -> Interval:
    """The t interval of the mean of per-seed paired differences. `sd_floor`: a noise arm's per-seed sd (what a
    difference with no effect spreads by); the interval uses the larger of it and the differences' own sd, with
    the fewer degrees of freedom of the two (`df_floor`), so a comparison whose seeds happen to agree cannot look
    surer than the noise the study measured. One value: low = high = mean."""
    n = len(diffs)
    m = statistics.mean(diffs)
    if n < 2:
        return Interval(m, m, m, n, level)
    sd, df = statistics.stdev(diffs), n - 1
    if sd_floor > sd:
        sd, df = sd_floor, min(df, df_floor if df_floor is not None else df)
    se = sd / math.sqrt(n)
    half = t_two_sided(level, df) * se
    p = 1.0 if se == 0 and m == 0 else 0.0 if se == 0 else 2.0 * (1.0 - t_cdf(abs(m) / se, df))
    return Interval(m, m - half, m + half, n, level, p)


def holm(named: dict[str, list[float]], alpha: float = 0.05, sd_floor: float = 0.0,
         df_floor: float | None = None) -> dict[str, tuple[Interval, bool]]:
    """Holm's step-down correction over the paired comparisons in `named` (name -> per-seed differences): each
    comparison's interval at the level its step of the procedure tests at (the i-th smallest p-value of m
    against alpha / (m - i + 1)), and whether Holm rejects a zero difference. Once one comparison is not
    rejected, every later one is not either, and takes that step's level (its interval is then descriptive).
    The family-wise error of the rejections is at most alpha; the intervals are the usual simultaneous reading
    of the step-down levels, not a confidence set of their own."""
    ivs = {k: paired(d, 1 - alpha, sd_floor, df_floor) for k, d in named.items()}
    order = sorted(named, key=lambda k: (ivs[k].p if ivs[k].p is not None else 1.0, k))
    m, out, stopped = len(order), {}, False
    for i, k in enumerate(order):
        a = alpha / (m - i)
        p = ivs[k].p
        reject = not stopped and p is not None and p <= a
        stopped |= not reject
        out[k] = (paired(named[k], 1 - a, sd_floor, df_floor), reject)
    return out


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given: max over the earlier steps of (m - i + 1) p_(i), capped at 1."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


# -- seed-count rules ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SeedRule:
    """"at least k of n seeds", as written for n seeds. Applied to another number of seeds it is either
    refused (`scale=False`: the rule must be restated for that n) or scaled as the fraction it states (at least
    ceil(k / n x seeds), exact rational arithmetic, so 2 of 3 with 10 seeds needs 7). It never becomes
    "at least k" of any number: that would let 2 successes of 10 pass a 2-of-3 rule."""

    k: int
    n: int
    scale: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.k <= self.n:
            raise ValueError(f"a rule 'at least k of n' needs 0 < k <= n, got {self.k} of {self.n}")

    def needed(self, seeds: int) -> int:
        """The successes required out of `seeds`; ValueError where the rule does not apply."""
        if seeds == self.n:
            return self.k
        if not self.scale:
            raise ValueError(f"the rule 'at least {self.k} of {self.n} seeds' was written for {self.n} seeds; "
                             f"restate it for {seeds}")
        if seeds < self.n:
            raise ValueError(f"the rule 'at least {self.k} of {self.n} seeds' needs {self.n} seeds, has {seeds}")
        return math.ceil(Fraction(self.k, self.n) * seeds)

    def passed(self, successes: int, seeds: int) -> bool:
        return successes >= self.needed(seeds)

    def describe(self, seeds: int) -> str:
        need = self.needed(seeds)
        return f"at least {self.k} of {self.n}" + ("" if seeds == self.n else f" (scaled: {need} of {seeds})")
