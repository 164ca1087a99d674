"""A run's life on the command line (issue 42): `--resume DIR` alone continues with the checkpoint's settings, a
larger `--steps` extends a finished run and `--lr` changes its peak, each said in one line; a new run never
appends to an earlier run's metrics; the summary's tokens/s is the median; `--tensorboard DIR` writes the
records as scalars beside the JSONL."""

import json
import statistics

import pytest
import torch
from safetensors.torch import load_file

from megatrain.cli import main

BASE = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--micro-batch", "2",
        "--dtype", "fp32", "--lr", "3e-3", "--no-progress"]


@pytest.fixture(scope="module")
def train_bin(tmp_path_factory):
    from runtime_schedules import make_token_files

    return str(make_token_files(tmp_path_factory.mktemp("tokens"))[0])


def weights(ckpt):
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_alone_extends_a_finished_run_bit_for_bit(tmp_path, train_bin, capsys):
    """Under a constant schedule, 3 steps then `--resume CK --steps 5` is the 5-step run, bit for bit: the
    extension changes nothing but the schedule's length."""
    flags = [*BASE, "--data", train_bin, "--schedule", "constant", "--warmup", "0", "--checkpoint-every", "5"]
    ref, ck = tmp_path / "ref", tmp_path / "ck"
    assert main([*flags, "--steps", "5", "--checkpoint-dir", str(ref)]) == 0
    assert main([*flags, "--steps", "3", "--checkpoint-dir", str(ck), "--metrics", str(tmp_path / "m.jsonl")]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(ck)]) == 0  # alone: the checkpoint's settings, nothing left to do
    out = capsys.readouterr().out
    assert "at step 3 of 3" in out and "a larger --steps extends the run" in out
    assert main(["train", "--resume", str(ck), "--steps", "5"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("extended:"))
    assert "ends at step 5 (was 3)" in line and "new length is 5 steps" in line
    assert [r["step"] for r in records(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5]  # the run's own log, continued
    want, got = weights(ref / "step-00000005"), weights(ck / "step-00000005")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_learning_rate_changes_on_resume_and_says_so(tmp_path, train_bin, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    flags = [*BASE, "--data", train_bin, "--schedule", "constant", "--warmup", "0", "--checkpoint-dir", str(ck),
             "--checkpoint-every", "2", "--metrics", str(metrics)]
    assert main([*flags, "--steps", "4", "--lr", "3e-3"]) == 0
    (ck / "step-00000004").rename(tmp_path / "later")  # continue from step 2
    capsys.readouterr()
    assert main(["train", "--resume", str(ck), "--lr", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert [x for x in out.splitlines() if x.startswith("learning rate changed: peak 0.001 (was 0.003) from step 3")]
    lrs = {r["step"]: r["lr"] for r in records(metrics)}
    assert lrs[2] == 3e-3 and lrs[3] == lrs[4] == 1e-3
    manifest = json.loads((ck / "step-00000004" / "manifest.json").read_text())
    assert manifest["settings"]["lr"] == 1e-3 and manifest["train"]["lr"] == 1e-3


def test_resume_keeps_refusing_other_settings(tmp_path, train_bin, capsys):
    ck = tmp_path / "ck"
    assert main([*BASE, "--data", train_bin, "--steps", "2", "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(ck), "--steps", "4", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed 0 vs 1" in err


def test_a_new_run_refuses_an_earlier_runs_metrics(tmp_path, train_bin, capsys):
    metrics = tmp_path / "m.jsonl"
    argv = [*BASE, "--data", train_bin, "--steps", "3", "--metrics", str(metrics)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recs = records(metrics)
    assert summary["tokens_per_s"] == round(statistics.median(r["tokens_per_s"] for r in recs), 1)
    before = metrics.read_text()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(metrics) in err and "--resume" in err and "remove" in err
    assert metrics.read_text() == before


class FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's calls the metrics log makes, recorded."""

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed, self.flushed = log_dir, [], False, 0

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        self.flushed += 1

    def close(self):
        self.closed = True


def test_tensorboard_gets_every_records_numbers(tmp_path, train_bin, monkeypatch):
    from megatrain.runtime import metrics as metric_logs

    made = []
    monkeypatch.setattr(metric_logs, "tensorboard_writer",
                        lambda logdir=None, check_only=False: None if check_only else made.append(FakeWriter(logdir))
                        or made[-1])
    jsonl, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    assert main([*BASE, "--data", train_bin, "--steps", "3", "--metrics", str(jsonl), "--tensorboard", str(tb)]) == 0
    [writer] = made
    assert writer.log_dir == str(tb) and writer.closed and writer.flushed
    for rec in records(jsonl):
        mine = {tag: v for tag, v, step in writer.scalars if step == rec["step"]}
        assert mine == metric_logs.scalars_of(rec) and {"loss", "lr", "tokens_per_s"} <= set(mine)


def test_tensorboard_missing_is_one_line_or_writes_event_files(tmp_path, train_bin, capsys):
    argv = [*BASE, "--data", train_bin, "--steps", "2", "--tensorboard", str(tmp_path / "tb")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pip install tensorboard" in err
        return
    assert main(argv) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
