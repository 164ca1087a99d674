"""The issue-20 benchmarks run end to end at toy sizes (their figures are in docs/RESULTS.md; no timing is
asserted here): each prints its table and writes a JSON record with the fields the table is built from."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_prediction_probes_plans_and_measures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRAIN_PROFILES", str(tmp_path / "profiles"))
    out = tmp_path / "pred.json"
    assert _bench("bench_prediction").main(["--cases", "tiny-1", "--rounds", "1", "--steps", "1", "--repeats", "1",
                                            "--reprobe", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["case"] == "tiny-1" and row["predicted_ms"] > 0 and row["measured_ms"] > 0
    assert row["ratio"] == pytest.approx(row["measured_ms"] / row["predicted_ms"])
    assert len(row["fresh_ratios"]) == 1 and row["fresh_ratio"] == row["fresh_ratios"][0] > 0  # one fresh probe
    assert "| tiny-1 |" in capsys.readouterr().out
    assert len(list((tmp_path / "profiles").glob("hardware-*.json"))) == 1  # the probe was cached


def test_bench_heuristics_runs_every_rule(tmp_path, capsys):
    out = tmp_path / "rules.json"
    assert _bench("bench_heuristics").main(["--model", "tiny", "--budgets", "64", "--rounds", "1", "--steps", "1",
                                            "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["budget_mib"] == 64
    for rule in ("every-4th", "all-host"):  # both fit in 64 MiB: each measured against the planner
        assert row[rule]["measured_s"] > 0 and row[rule]["over_planner"] > 0
    assert "| 64 MiB |" in capsys.readouterr().out


def test_bench_vs_transformers_runs_four_ways(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf.json"
    assert _bench("bench_vs_transformers").main(["--model", "tiny", "--budgets", "8,64", "--rounds", "1",
                                                 "--steps", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["rows"]) == {"hf", "hf+ckpt", "streamed-8MiB", "streamed-64MiB"}
    assert all(r["median_s"] > 0 for r in got["rows"].values())
    assert set(got["pairs"]) == {f"{s} / {h}" for s in ("streamed-8MiB", "streamed-64MiB") for h in ("hf", "hf+ckpt")}
    assert "streamed-8MiB / hf+ckpt" in capsys.readouterr().out


def test_bench_recompute_checks_bits_and_times_both_ways(tmp_path, capsys):
    out = tmp_path / "recompute.json"
    assert _bench("bench_recompute").main(["--model", "tiny", "--seq", "64", "--chunk", "16", "--rounds", "1",
                                           "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["untiled", "tiled 16"]
    assert all(r["full_s"] > 0 and r["unevaluated_s"] > 0 for r in rows)
    assert "| tiled 16 |" in capsys.readouterr().out


def test_bench_cast_times_both_ways_per_thread_count(tmp_path, capsys):
    out = tmp_path / "cast.json"
    assert _bench("bench_cast").main(["--elements", "200000", "--rounds", "1", "--threads", "1,2",
                                      "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["way"], r["threads"]) for r in rows} == {(w, k) for w in ("torch copy_", "C cast") for k in (1, 2)}
    assert all(r["best_g_per_s"] >= r["median_g_per_s"] > 0 for r in rows)
    assert "| 2 | C cast |" in capsys.readouterr().out
