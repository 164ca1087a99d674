"""The studies' decision code (benchmarks/stats.py, issue 43) against published tables and worked examples, and
the host-policy shadow run at a toy size."""

import importlib
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other by file name


def _bench(name: str):
    return importlib.import_module(name)


stats = _bench("stats")

# two-sided 95% critical values t_{0.975, df}, to the digits statistical tables print
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 5: 2.571, 9: 2.262, 10: 2.228, 30: 2.042, 100: 1.984}


@pytest.mark.parametrize(("df", "t"), sorted(T975.items()))
def test_t_quantiles_match_the_table(df, t):
    assert stats.t_two_sided(0.95, df) == pytest.approx(t, abs=5e-4)


def test_t_quantile_at_30_df_and_its_limits():
    assert round(stats.t_two_sided(0.95, 30), 3) == 2.042
    assert stats.t_two_sided(0.95, 30) == pytest.approx(2.0422724563, abs=1e-8)
    assert stats.t_quantile(0.995, 3) == pytest.approx(5.8409093, abs=1e-6)  # 99% two-sided, 3 df
    assert stats.t_two_sided(0.95, 1e7) == pytest.approx(1.959964, abs=1e-5)  # the normal's
    assert stats.t_quantile(0.025, 10) == -stats.t_quantile(0.975, 10)
    for df in (1, 2.5, 7, 40):
        for p in (0.6, 0.9, 0.999):
            assert stats.t_cdf(stats.t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_betainc_known_values():
    assert stats.betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert stats.betainc(2, 3, 0.4) == pytest.approx(0.5248)  # P(Binomial(4, 0.4) >= 2)
    assert stats.betainc(0.5, 0.5, 0.5) == pytest.approx(0.5)
    assert stats.t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi


def test_two_of_three_with_ten_seeds_is_not_passed_by_two():
    rule = stats.SeedRule(2, 3)
    assert rule.passed(2, 3) and not rule.passed(1, 3)
    assert not rule.passed(2, 10)
    assert rule.needed(10) == 7 and rule.passed(7, 10) and not rule.passed(6, 10)
    assert rule.needed(6) == 4  # exactly 2/3 of 6
    with pytest.raises(ValueError, match="needs 3 seeds"):
        rule.needed(2)
    strict = stats.SeedRule(2, 3, scale=False)
    with pytest.raises(ValueError, match="restate it for 10"):
        strict.passed(9, 10)
    assert "scaled: 7 of 10" in rule.describe(10)


def test_study_moe_reads_the_rule_with_its_n():
    moe = _bench("study_moe")
    assert moe.SEED_RULE == stats.SeedRule(2, 3)
    ok, how = moe._seed_rule([2, 2], [10, 10])
    assert ok is False and "7 of 10" in how
    assert moe._seed_rule([2, 3], [3, 3]) == (True, "at least 2 of 3")
    assert moe._seed_rule([2, 2], [2, 2])[0] is None  # too few seeds: not applicable
    assert moe.BIAS_RATE == 1e-3 and moe.model("tc-bias", 200).moe.bias_rate == 1e-3
    assert moe.key("tc-bias", 1024, 0, 200, 4096).endswith("|u0.001")  # a run at the old rate is never reused
    old = moe.relabel([{"arm": "tc-bias", "bias_rate": 0.1}, {"arm": "tc-bias", "bias_rate": 1e-3}])
    assert [r["arm"] for r in old] == ["tc-bias@0.1", "tc-bias"]


def test_holm_on_a_known_example():
    # Holm (1979)'s textbook case: p = 0.01, 0.04, 0.03, 0.005 at alpha 0.05 -> adjusted 0.03, 0.06, 0.06, 0.02
    assert stats.holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # on intervals: one clear effect and two nulls; the clear one is tested at alpha / 3, the next at alpha / 2
    named = {"a": [1.0, 1.1, 0.9, 1.05, 0.95], "b": [0.1, -0.1, 0.05, -0.02, 0.0], "c": [0.3, -0.2, 0.1, 0.0, -0.1]}
    out = stats.holm(named)
    (iv_a, rej_a), (iv_b, rej_b), (iv_c, rej_c) = out["a"], out["b"], out["c"]
    assert rej_a and not rej_b and not rej_c
    assert iv_a.level == pytest.approx(1 - 0.05 / 3)
    assert sorted([iv_b.level, iv_c.level]) == pytest.approx([0.95, 1 - 0.05 / 2])
    half = stats.t_two_sided(1 - 0.05 / 3, 4) * 0.079056941504 / math.sqrt(5)  # sd of a's values
    assert iv_a.high - iv_a.mean == pytest.approx(half, rel=1e-9)


def test_holm_stops_at_the_first_failure():
    # y and z each have p below alpha (0.033, 0.042) but above alpha / 2: once y fails, z is not rejected either
    named = {"x": [0.5, 0.52, 0.49, 0.51, 0.5], "y": [0.03, 0.05, 0.0, 0.03, 0.02], "z": [0.03, 0.05, 0.0, 0.02, 0.02]}
    out = stats.holm(named)
    ps = {k: stats.paired(v).p for k, v in named.items()}
    assert 0.025 < ps["y"] < ps["z"] < 0.05
    assert out["x"][1] and not out["y"][1] and not out["z"][1]
    assert out["z"][0].level == pytest.approx(0.95) and out["z"][0].excludes_zero()  # its own level, not Holm's
    assert stats.holm_adjusted([0.001, 0.03, 0.04]) == pytest.approx([0.003, 0.06, 0.06])


def test_the_noise_floor_widens_an_interval_that_looks_too_sure():
    d = [0.010, 0.011, 0.012]
    tight = stats.paired(d)
    floored = stats.paired(d, sd_floor=0.02, df_floor=9)
    assert floored.high - floored.low > tight.high - tight.low
    assert floored.high - floored.mean == pytest.approx(stats.t_two_sided(0.95, 2) * 0.02 / math.sqrt(3))
    assert stats.paired(d, sd_floor=0.0001) == tight  # a floor below the spread changes nothing


def test_study_runs_paired_has_no_table_limit():
    runs = _bench("study_runs")
    d = [0.01 * (i % 3) for i in range(31)]
    m, lo, hi = runs.paired(d)  # 30 degrees of freedom: the old table stopped at 9
    assert hi - m == pytest.approx(2.042272 * statistics.stdev(d) / math.sqrt(31), rel=1e-6)


def test_the_host_policy_shadow_run_is_exact_for_exact(tmp_path):
    """A few steps of the shadow estimator: the control arm stays within round-off of exact, and every policy's
    record has the fields the table reads."""
    q = _bench("quality_host_policy")
    from megatrain.runtime.corpus import cached_default_corpus

    rec = q.shadow_run(q.model(1), seed=0, steps=6, beta2=0.999, data=cached_default_corpus(), val_batches=1,
                       points=2)
    assert [p["step"] for p in rec["points"]] == [3, 6]
    end = rec["points"][-1]
    assert set(end) == {"step", "exact", *q.SHADOWS}
    assert abs(end["control"]["cost"]) < 1e-4 and end["control"]["drift"] < 1e-4
    assert all(math.isfinite(end[p]["cost"]) and end[p]["drift"] > 0 for p in ("bf16-moments", "bf16", "fp8"))
    iv, ok = q._decide([rec, {**rec, "seed": 1}], "fp8", 0.999)
    assert iv.n == 2 and ok == (iv.high <= q.QUALITY_TOLERANCE)
