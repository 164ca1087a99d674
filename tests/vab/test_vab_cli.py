"""`megatrain-vab` (megatrain/cli/vab.py): generate, run, report, export through its parser; `python -m
megatrain.cli.vab` as a subprocess; its former spelling `megatrain vab`; and that it stays out of the training
CLI's help and imports none of the training stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vab_testing import write_lines

from megatrain.cli import main as megatrain_main
from megatrain.cli import vab as cli
from megatrain.vab.errors import VabError
from megatrain.vab.runner import load_results


def vab(*argv: str) -> int:
    args = cli.build_parser().parse_args(list(argv))
    return args.func(args)


def test_generate_run_report_round_trip(tmp_path, capsys):
    tasks, scores, out = tmp_path / "t.jsonl", tmp_path / "s.jsonl", tmp_path / "r.jsonl"
    assert vab("generate", "--out", str(tasks), "--n", "15", "--scores", str(scores), "--noise", "0") == 0
    assert vab("run", "--tasks", str(tasks), "--judge", f"scores:{scores}", "--out", str(out)) == 0
    assert "ran 135 trials, skipped 0" in capsys.readouterr().out
    assert vab("run", "--tasks", str(tasks), "--judge", f"scores:{scores}", "--out", str(out)) == 0
    assert "ran 0 trials, skipped 135" in capsys.readouterr().out
    assert vab("report", str(out), "--boot", "100") == 0
    printed = capsys.readouterr().out
    assert "pass^3" in printed and "tb1" in printed and "fine-art" in printed
    report = json.loads((tmp_path / "r.report.json").read_text())
    assert report["n_tasks"] == 15
    assert report["overall"]["metrics"]["tb1"]["pass3"]["value"] == 1.0  # noiseless scores track the truth


def test_run_subset_of_protocols_with_limit_and_compare(tmp_path, capsys):
    tasks, a, b = tmp_path / "t.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    vab("generate", "--out", str(tasks), "--n", "30", "--sizes", "3,4")
    vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(a), "--protocols", "pick_best")
    vab("run", "--tasks", str(tasks), "--judge", "position:1", "--out", str(b), "--protocols", "pick_best",
        "--limit", "20")
    assert {r.protocol for r in load_results(a)[0]} == {"pick_best"}
    assert len(load_results(b)[0]) == 20 * 3
    capsys.readouterr()
    vab("report", str(a), "--compare", str(b), "--json", str(tmp_path / "rep.json"), "--boot", "50")
    printed = capsys.readouterr().out
    assert "McNemar top1 pass^3" in printed and "n 20" in printed
    assert set(json.loads((tmp_path / "rep.json").read_text())["overall"]["metrics"]) == {"top1"}


def test_cmd_judge_end_to_end(tmp_path, capsys):
    tasks, out = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    vab("generate", "--out", str(tasks), "--n", "2", "--sizes", "3")
    judge = "cmd:cat > /dev/null; echo 'I pick'; echo 'BEST: A'; echo 'WORST: C'"
    assert vab("run", "--tasks", str(tasks), "--judge", judge, "--out", str(out), "--retry-delays", "0") == 0
    results, _ = load_results(out)
    assert len(results) == 18 and all(r.valid for r in results)
    assert all(r.best == r.truth_best or not r.correct_best for r in results if r.best)


def test_export_writes_pairs_and_refuses_leaks(tmp_path, capsys):
    train, evl, out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl", tmp_path / "pairs.jsonl"
    vab("generate", "--out", str(train), "--n", "6", "--prefix", "train_")
    vab("generate", "--out", str(evl), "--n", "6", "--prefix", "eval_", "--seed", "1")
    assert vab("export", "--train", str(train), "--eval", str(evl), "--out", str(out), "--no-image-check") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and {"prompt", "answer", "images", "task_id"} <= set(rows[0])
    with pytest.raises(VabError, match="in the evaluation split"):
        vab("export", "--train", str(train), "--eval", str(train), "--out", str(out))


def test_agreement_command(tmp_path, capsys):
    rows = [{"annotator": f"h{a}", "task_id": f"t{t}", "scores": {"A": 3, "B": 2, "C": 1}, "ranking": ["A", "B", "C"]}
            for a in range(6) for t in range(4)]
    labels = write_lines(tmp_path / "h.jsonl", rows)
    assert vab("agreement", str(labels), "--json", str(tmp_path / "a.json")) == 0
    printed = capsys.readouterr().out
    assert "self-consistency: best 100.0%" in printed and "mean Kendall tau 1.000" in printed
    assert json.loads((tmp_path / "a.json").read_text())["comparisons"][0]["direct"] == 1.0


def test_user_errors_raise_vab_error_and_main_exits_2(tmp_path, capsys):
    tasks = tmp_path / "t.jsonl"
    vab("generate", "--out", str(tasks), "--n", "3")
    with pytest.raises(VabError, match="unknown judge spec 'gpt5'"):
        vab("run", "--tasks", str(tasks), "--judge", "gpt5", "--out", str(tmp_path / "r.jsonl"))
    with pytest.raises(VabError, match="unknown protocol"):
        vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(tmp_path / "r.jsonl"), "--protocols", "x")
    with pytest.raises(VabError, match="not a comma list of integers"):
        vab("generate", "--out", str(tasks), "--sizes", "2,three")
    bad = write_lines(tmp_path / "bad.jsonl", ['{"task_id": "a"}'])
    code = cli.main(["run", "--tasks", str(bad), "--judge", "oracle", "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "bad.jsonl:1: field 'domain'" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(VabError, match="holds no finished trials"):
        vab("report", str(write_lines(tmp_path / "empty.jsonl", [""])))


@pytest.mark.parametrize("argv, message", [
    # each once a traceback (issue 41): OverflowError in the retry's sleep, RecursionError, MemoryError
    (["run", "--judge", "cmd:false", "--retry-delays", "inf"], "--retry-delays 'inf': each value must be"),
    (["run", "--judge", "cmd:false", "--retry-delays", "2,nan"], "must be a number of seconds in [0, 86,400]"),
    (["run", "--judge", "cmd:false", "--retry-delays", "1e308"], "got 1e+308"),
    (["report", "DEEP"], "deep.jsonl:1: not valid JSON (RecursionError"),
    (["report", "/dev/zero"], "/dev/zero: not a regular file"),
    (["report", "WIDE", "--compare", "/dev/zero"], "/dev/zero: not a regular file"),
    (["generate", "--sizes", "2,\uff13"], "not a comma list of integers"),
])
def test_hostile_values_and_files_are_one_line(tmp_path, capsys, argv, message):
    tasks, out = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    vab("generate", "--out", str(tasks), "--n", "3")
    vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(tmp_path / "wide.jsonl"))
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    capsys.readouterr()
    argv = [{"DEEP": str(tmp_path / "deep.jsonl"), "WIDE": str(tmp_path / "wide.jsonl")}.get(a, a) for a in argv]
    if argv[0] == "run":
        argv += ["--tasks", str(tasks), "--out", str(out), "--attempts", "2"]
    elif argv[0] == "generate":
        argv += ["--out", str(tmp_path / "g.jsonl")]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


RESTATING_JUDGE = "cmd:cat > /dev/null; echo 'At first BEST: B, WORST: A.'; echo 'BEST: A'; echo 'WORST: C'"


def test_parse_mode_is_chosen_on_run_recorded_and_reported(tmp_path, capsys):
    tasks, official, strict = tmp_path / "t.jsonl", tmp_path / "o.jsonl", tmp_path / "s.jsonl"
    vab("generate", "--out", str(tasks), "--n", "2", "--sizes", "3")
    assert vab("run", "--tasks", str(tasks), "--judge", RESTATING_JUDGE, "--out", str(official)) == 0
    assert "(parse official): ran 18 trials" in capsys.readouterr().out
    assert vab("run", "--tasks", str(tasks), "--judge", RESTATING_JUDGE, "--out", str(strict), "--parse", "strict") == 0
    by_mode = {mode: load_results(path)[0] for mode, path in (("official", official), ("strict", strict))}
    assert all(r.parse == mode for mode, rs in by_mode.items() for r in rs)
    # the two modes read the same text differently: official the early mention (presented B and A), strict the
    # trailing lines (presented A and C); results hold original labels, the order maps presented back
    for mode, (at_best, at_worst) in (("official", (1, 0)), ("strict", (0, 2))):
        joint = [r for r in by_mode[mode] if r.protocol == "pick_best_and_worst"]
        assert len(joint) == 6 and all(r.valid for r in joint)
        assert all((r.best, r.worst) == ("ABC"[r.order[at_best]], "ABC"[r.order[at_worst]]) for r in joint), mode
    for mode, path in (("official", official), ("strict", strict)):
        capsys.readouterr()
        assert vab("report", str(path), "--boot", "20") == 0
        printed = capsys.readouterr().out
        assert f"parse {mode}" in printed and f"parse mode {mode}:" in printed
        assert json.loads(path.with_suffix(".report.json").read_text())["parse"] == mode


def test_resume_and_compare_refuse_another_parse_mode(tmp_path, capsys):
    tasks, official, strict = tmp_path / "t.jsonl", tmp_path / "o.jsonl", tmp_path / "s.jsonl"
    vab("generate", "--out", str(tasks), "--n", "3")
    vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(official))
    vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(strict), "--parse", "strict")
    with pytest.raises(VabError, match="holds answers parsed in official mode, not strict; pass --parse official"):
        vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(official), "--parse", "strict")
    capsys.readouterr()
    with pytest.raises(VabError, match=r"o.jsonl was parsed in official mode and .*s.jsonl in strict mode, so their "
                                       "scores are not comparable"):
        vab("report", str(official), "--compare", str(strict))
    assert capsys.readouterr().out == ""  # refused before printing a report
    assert not official.with_suffix(".report.json").exists()


def test_a_results_file_from_before_parse_modes_reads_as_strict(tmp_path, capsys):
    tasks, out = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    vab("generate", "--out", str(tasks), "--n", "2")
    vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(out), "--parse", "strict")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    write_lines(out, [{k: v for k, v in row.items() if k not in ("parse", "judge_failed")} for row in rows])
    assert {r.parse for r in load_results(out)[0]} == {"strict"}
    with pytest.raises(VabError, match="pass --parse strict to resume it"):
        vab("run", "--tasks", str(tasks), "--judge", "oracle", "--out", str(out))


def test_export_compares_image_contents(tmp_path, capsys):
    for split in ("train", "eval"):
        vab("generate", "--out", str(tmp_path / f"{split}.jsonl"), "--n", "3", "--prefix", f"{split}_")
        for row in map(json.loads, (tmp_path / f"{split}.jsonl").read_text().splitlines()):
            for image in row["images"]:
                (tmp_path / image).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / image).write_bytes(image.encode())
    argv = ("export", "--train", str(tmp_path / "train.jsonl"), "--eval", str(tmp_path / "eval.jsonl"),
            "--out", str(tmp_path / "pairs.jsonl"))
    assert vab(*argv) == 0
    train_image = tmp_path / "images" / "train_fine-art_calligraphy_0000" / "B.jpg"
    eval_image = next((tmp_path / "images").glob("eval_*/A.jpg"))
    train_image.write_bytes(eval_image.read_bytes())
    with pytest.raises(VabError, match=f"training image {train_image} .* byte-identical to evaluation image "
                                       f"{eval_image}"):
        vab(*argv)
    assert vab(*argv, "--no-image-check") == 0


def _module_cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain.cli.vab", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_python_dash_m_runs_the_vab_commands(tmp_path):
    done = _module_cli("generate", "--out", "t.jsonl", "--n", "4", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "wrote 4 tasks to t.jsonl\n"
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 4
    done = _module_cli("run", "--tasks", "t.jsonl", "--judge", "oracle", "--out", "r.jsonl", cwd=tmp_path)
    assert done.returncode == 0 and "oracle (parse official): ran 36 trials" in done.stdout
    done = _module_cli("report", "r.jsonl", "--boot", "20", cwd=tmp_path)
    assert done.returncode == 0 and "parse official" in done.stdout
    assert json.loads((tmp_path / "r.report.json").read_text())["overall"]["metrics"]["tb1"]["pass3"]["value"] == 1.0
    done = _module_cli("run", "--tasks", "missing.jsonl", "--judge", "oracle", "--out", "x.jsonl",
                       cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1
    done = _module_cli("run", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "--parse {official,strict}" in done.stdout


def test_vab_is_its_own_command_and_its_former_spelling_still_runs(tmp_path, capsys):
    from megatrain.cli import build_parser

    assert "vab" not in build_parser().format_help()  # out of the training CLI's help
    assert "generate" in cli.build_parser().format_help()
    out = tmp_path / "t.jsonl"
    assert megatrain_main(["vab", "generate", "--out", str(out), "--n", "3"]) == 0
    captured = capsys.readouterr()
    assert "is now its own command, `megatrain-vab" in captured.err and out.exists()
    code = ("import sys, megatrain.cli.vab; "
            "print(sorted(m for m in ('torch', 'megatrain.runtime', 'megatrain.planner') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
