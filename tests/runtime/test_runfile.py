"""`megatrain train --config run.toml`: every setting in a file, flags override it, the effective settings
printed at start and saved in every checkpoint manifest."""

import json
import os

import pytest

from megatrain.cli import main
from megatrain.runtime.checkpoint import find_checkpoint, read_manifest
from megatrain.runtime.config import RunConfig
from megatrain.runtime.runfile import read_run_file

RUN = """
model = "tiny"
device = "sim"
steps = 2
no_progress = true

[budget]
gpu_mem = "6MiB"
seq_len = 64
micro_batch = 2
dtype = "fp32"

[optimizer]
lr = 3e-3
betas = [0.9, 0.99]
schedule = "wsd"

[checkpoint]
checkpoint-every = 2
"""


@pytest.fixture()
def data(tmp_path):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path)[0]


def test_run_file_settings_flags_override_and_the_manifest_keeps_them(tmp_path, data, capsys):
    run = tmp_path / "run.toml"
    run.write_text(RUN + f'[data]\ndata = "{data}"\ncheckpoint_dir = "{tmp_path / "ck"}"\n')
    assert main(["train", "--config", str(run), "--lr", "1e-3"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("settings: ") and "lr=0.001" in first and "schedule=wsd" in first
    assert "betas=0.9,0.99" in first and "gpu-mem=6MiB" in first
    manifest = read_manifest(find_checkpoint(tmp_path / "ck"))
    assert manifest["settings"]["lr"] == 0.001 and manifest["settings"]["steps"] == 2
    assert manifest["settings"]["data"] == str(data)
    assert manifest["train"]["betas"] == [0.9, 0.99] and manifest["train"]["schedule"] == "wsd"
    assert manifest["train"]["lr"] == 0.001  # the flag won over the file


def test_the_printed_and_stored_settings_are_a_run_file_of_the_same_run(tmp_path, data, capsys):
    """What a run prints, what its manifest stores and what a run file holds are one value: the stored settings
    (profile included) written as TOML load back into an equal RunConfig, and the CLI runs from them."""
    ck = tmp_path / "ck"
    assert main(["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
                 "--micro-batch", "2", "--dtype", "fp32", "--steps", "2", "--data", str(data), "--no-progress",
                 "--checkpoint-every", "2", "--checkpoint-dir", str(ck)]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    stored = read_manifest(find_checkpoint(ck))["settings"]
    assert stored["profile"] == "auto" and stored["gpu-mem"] == "6MiB"
    assert printed == "settings: " + ", ".join(
        f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in stored.items())
    run = tmp_path / "again.toml"
    run.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in stored.items()))
    assert RunConfig.from_settings(read_run_file(run)) == RunConfig.from_settings(stored)
    assert main(["train", "--config", str(run), "--resume", str(ck)]) == 0  # at step 2 of 2: nothing to train
    out = capsys.readouterr().out
    assert "nothing left to train" in out and out.splitlines()[0].replace(f", resume={ck}", "") == printed


BAD = [
    ("lrr = 1\n", "unknown setting 'lrr'"),
    ("[a.b]\nlr = 1\n", "nests a table in a table"),
    ("lr = \"fast\"\n", "lr: 'fast' is not a valid float"),
    ("steps = true\n", "steps: expected a number"),
    ("pack = 1\n", "pack: expected true or false"),
    ("schedule = \"step\"\n", "schedule: 'step' is not one of cosine, linear, constant, wsd"),
    ("data = \"\"\n", "data: an empty value"),
    ("lr = nan\n", "lr: nan is not a finite number"),
    ("lr = 1\n[o]\nlr = 2\n", "lr is set twice"),
    ("model = [\n", "not valid TOML"),
    ("[" * 100000 + "\n", "not valid TOML"),
    ("steps = \"\uff15\"\n", "steps: '\uff15' is not a valid int; write it in the digits 0-9"),  # fullwidth 5
    ("lr = \"\uff11e-3\"\n", "lr: '\uff11e-3' is not a valid float"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_bad_run_files_are_refused_in_one_line(tmp_path, text, message, capsys):
    run = tmp_path / "run.toml"
    run.write_text(text)
    assert main(["train", "--config", str(run), "--model", "tiny", "--steps", "1", "--seq-len", "8",
                 "--gpu-mem", "6MiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and "run.toml" in err and err.count("\n") == 1, err


def test_run_files_that_are_not_files(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "dir.toml").mkdir()
    for name, message in (("fifo.toml", "not a regular file"), ("dir.toml", "Is a directory"),
                          ("missing.toml", "cannot read")):
        assert main(["train", "--config", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["train", "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.toml")]) == 2
    assert "--config is given twice" in capsys.readouterr().err


def test_run_file_paths_are_the_run_files_and_tilde_is_home(tmp_path, data, monkeypatch, capsys):
    """Relative paths in a run file are taken from its folder, not the current one; `~` is the home folder, in
    a run file and in a flag, never a folder named `~` (issue 41)."""
    conf, home, elsewhere = tmp_path / "conf", tmp_path / "home", tmp_path / "elsewhere"
    for d in (conf, home, elsewhere):
        d.mkdir()
    for name in ("train.bin", "train.bin.json"):
        (conf / name).write_bytes((data.parent / name.replace("train", data.stem)).read_bytes())
    (conf / "run.toml").write_text(RUN + '[data]\ndata = "train.bin"\ncheckpoint_dir = "ck"\n'
                                   'metrics = "~/m.jsonl"\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", "../conf/run.toml", "--trace", "~/t.json"]) == 0, capsys.readouterr().err
    assert find_checkpoint(conf / "ck").name == "step-00000002"
    assert (home / "m.jsonl").is_file() and (home / "t.json").is_file()
    assert list(elsewhere.iterdir()) == []  # no ./ck, no ./train.bin read, no folder named ~


def test_ascii_digits_only_in_number_flags(capsys):
    for flag, value in (("--steps", "\uff15"), ("--seq-len", "\u0666\u0664"), ("--lr", "\uff11e-3"),
                        ("--steps", "1_0")):
        argv = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--steps",
                "2", flag, value]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: {value!r} is not" in err and "digits 0-9" in err and err.count("\n") == 1, err


def test_help_documents_the_run_file(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--config RUN.toml" in capsys.readouterr().out
