"""Preemption and folder ownership with real `megatrain train` processes.

SIGTERM (what schedulers send before a preemption) or SIGINT stops a run after the step in flight, writes a
checkpoint of that step and exits 143 / 130 with one line naming it; resumed, the run ends bit-identical to
one never stopped. A second signal ends the process at once and leaves only whole checkpoints. Two runs on one
checkpoint folder: the second is refused naming the first's pid; a killed run's lock is taken over.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatrain.runtime.checkpoint import read_manifest, step_dirs

TIMEOUT_S = 240
PAUSED = str(Path(__file__).with_name("paused_train.py"))  # megatrain with the test pause
STEPS = 24  # long enough that a signal sent after step 2 finds the run mid-training on a loaded machine (with 8,
# a run could finish and be exiting, where the interpreter's default disposition ends it at once: -2, no message)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"), "sphinx of black quartz, judge my vow. ")[0]


def argv(token_file, ckpt, steps=STEPS, *extra):
    return ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
            "--micro-batch", "2", "--dtype", "fp32", "--steps", str(steps), "--lr", "3e-3", "--warmup", "1",
            "--data", str(token_file), "--no-progress", "--checkpoint-every", str(steps), "--checkpoint-dir",
            str(ckpt), "--metrics", str(ckpt.parent / f"{ckpt.name}.jsonl"), *extra]


def start(args, tmp_path, pause=None):
    env = {**os.environ, "MEGATRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("MEGATRAIN_TEST_PAUSE_AT", None)
    if pause:
        env["MEGATRAIN_TEST_PAUSE_AT"] = pause
    return subprocess.Popen([sys.executable, PAUSED, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def reached_step(metrics, step, proc) -> bool:
    """Whether the metrics log has a record of `step` (the run is mid-training); fails if the run has exited."""
    if metrics.exists() and sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= step:
        return True
    if proc.poll() is not None:
        pytest.fail(f"exited {proc.returncode} early: {proc.stderr.read()[-2000:]}")
    return False


def wait_for_step(metrics, step, proc):
    """Until the metrics log has a record of `step` (the run is mid-training)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if reached_step(metrics, step, proc):
            return
        time.sleep(0.05)
    pytest.fail("the run never got going")


def tensors(ckpt):
    return {f.name: load_file(f) for f in sorted(ckpt.glob("*.safetensors"))}


def test_sigterm_and_sigint_stop_after_the_step_and_resume_bit_identical(token_file, tmp_path):
    ref, term, intr = tmp_path / "ref", tmp_path / "term", tmp_path / "int"
    runs = {ck: start(argv(token_file, ck), tmp_path) for ck in (ref, term, intr)}
    # each signalled as soon as it is at step 2: waiting for one run first let the other, built and stepping
    # faster on a loaded machine, finish and be exiting when its signal came (-2, no message)
    pending = {term: signal.SIGTERM, intr: signal.SIGINT}
    deadline = time.monotonic() + TIMEOUT_S
    while pending and time.monotonic() < deadline:
        for ck, sig in list(pending.items()):
            if reached_step(ck.parent / f"{ck.name}.jsonl", 2, runs[ck]):
                runs[ck].send_signal(sig)
                del pending[ck]
        time.sleep(0.02)
    assert not pending, "the runs never got going"
    outs = {ck: p.communicate(timeout=TIMEOUT_S) for ck, p in runs.items()}
    assert runs[ref].returncode == 0, outs[ref][1][-2000:]
    for ck, code, name in ((term, 143, "SIGTERM"), (intr, 130, "SIGINT")):
        assert runs[ck].returncode == code, outs[ck][1][-2000:]
        err = outs[ck][1].strip().splitlines()
        (stopped,) = [s for s, _ in step_dirs(ck)]
        assert 2 <= stopped < STEPS
        assert err[-1] == (f"error: stopped by {name} after step {stopped}: checkpoint {ck / f'step-{stopped:08d}'} "
                           f"written; resume with --resume {ck}")
        assert read_manifest(ck / f"step-{stopped:08d}")["step"] == stopped
    resumed = {ck: start(argv(token_file, ck, STEPS, "--resume", str(ck)), tmp_path) for ck in (term, intr)}
    for ck, p in resumed.items():
        out, err = p.communicate(timeout=TIMEOUT_S)
        assert p.returncode == 0, err[-2000:]
        want, got = tensors(ref / f"step-{STEPS:08d}"), tensors(ck / f"step-{STEPS:08d}")
        assert want.keys() == got.keys()
        for f in want:
            assert want[f].keys() == got[f].keys() and all((want[f][k] == got[f][k]).all() for k in want[f]), f


def test_a_second_signal_stops_at_once_and_leaves_only_whole_checkpoints(token_file, tmp_path):
    ck = tmp_path / "ck"
    p = start(argv(token_file, ck, 400, "--checkpoint-every", "1"), tmp_path)
    wait_for_step(tmp_path / "ck.jsonl", 3, p)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=TIMEOUT_S)
    assert p.returncode in (-signal.SIGTERM, 143)
    assert step_dirs(ck) and all(read_manifest(d)["step"] == s for s, d in step_dirs(ck))


def test_a_second_run_on_the_same_checkpoint_folder_is_refused_and_a_dead_runs_lock_taken_over(token_file,
                                                                                              tmp_path):
    ck = tmp_path / "ck"
    first = start(argv(token_file, ck, 4, "--checkpoint-every", "1"), tmp_path, pause="optimizer:2")
    line = ""
    while "paused at" not in line:  # the first run holds the folder, asleep in its host optimizer
        line = first.stderr.readline()
        assert line or first.poll() is None, "the first run ended before pausing"
    second = start(argv(token_file, ck, 4), tmp_path)
    _, err = second.communicate(timeout=TIMEOUT_S)
    assert second.returncode == 2
    assert err.strip().splitlines()[-1] == (f"error: {ck}: another megatrain run (pid {first.pid}) is writing "
                                            "checkpoints here; wait for it, stop it, or pass another --checkpoint-dir")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=TIMEOUT_S)
    third = start(argv(token_file, ck, 4, "--resume", str(ck)), tmp_path)  # the lock died with its holder
    _, err = third.communicate(timeout=TIMEOUT_S)
    assert third.returncode == 0, err[-2000:]
    assert [s for s, _ in step_dirs(ck)][-1] == 4
