"""SIGKILL at random points while checkpoints are written as training goes on (`--checkpoint-every 1`: every
step writes the previous step's checkpoint): the folder keeps a complete earlier checkpoint, and a resume from it
ends bit-identical to a run never killed.

Each trial is a real `megatrain train` subprocess killed a random time after its first checkpoint is sealed
(the kill lands in a step's compute, a unit file's write, a seal or between them); the resume runs in this
process on the plan test_checkpoint.py's Trainers share. Two trials run in the default suite, twenty under
`-m slow` (two processes at a time).
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from checkpoint_helpers import SPEC, assert_same_state, make, snapshot

from megatrain.runtime.checkpoint import read_manifest, step_dirs

STEPS = 12
TRAIN = SPEC.replace(total_steps=STEPS)
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def uninterrupted(token_files):
    with make(token_files, TRAIN) as t:
        t.run(progress=False)
        return snapshot(t.store)


def _start(token_files, ck, cache):
    argv = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--micro-batch",
            "2", "--dtype", "fp32", "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "1", "--data",
            str(token_files[0]), "--no-progress", "--checkpoint-every", "1", "--checkpoint-dir", str(ck)]
    env = {**os.environ, "MEGATRAIN_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "megatrain", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_after_first_seal(proc, ck, delay: float) -> None:
    start = time.monotonic()
    while not step_dirs(ck):
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before its first checkpoint: {proc.stderr.read()[-2000:]}")
        if time.monotonic() - start > TIMEOUT_S:
            proc.kill()
            pytest.fail("no checkpoint within the timeout")
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=TIMEOUT_S)


def _trials(token_files, tmp_path, uninterrupted, seeds) -> None:
    for pair in [seeds[k : k + 2] for k in range(0, len(seeds), 2)]:
        runs = []
        for seed in pair:
            ck = tmp_path / f"ck{seed}"
            runs.append((seed, ck, _start(token_files, ck, tmp_path / "cache")))
        for seed, ck, proc in runs:
            _kill_after_first_seal(proc, ck, random.Random(seed).uniform(0.0, 1.5))
        for seed, ck, proc in runs:
            kept = step_dirs(ck)
            temporaries = [p.name for p in ck.iterdir() if p.name.startswith(".step-")]
            print(f"trial {seed}: rc {proc.returncode}, kept {[s for s, _ in kept]}, left {temporaries}")
            assert kept, f"trial {seed}: no checkpoint left"
            for _, path in kept:
                read_manifest(path)  # whole: its manifest is its own sha256's
            if proc.returncode == 0:
                continue  # the run ended before the kill: nothing to resume
            assert proc.returncode == -signal.SIGKILL
            with make(token_files, TRAIN, resume=ck, checkpoint_dir=ck, checkpoint_every=1) as t:
                t.run(progress=False)
                assert_same_state(snapshot(t.store), uninterrupted)
            assert not [p for p in ck.iterdir() if p.name.startswith(".step-")], f"trial {seed}: a temporary stayed"


def test_two_random_kills_while_streaming_checkpoints_resume_bit_identically(token_files, tmp_path, uninterrupted):
    _trials(token_files, tmp_path, uninterrupted, [1, 2])


@pytest.mark.slow
def test_twenty_random_kills_while_streaming_checkpoints_resume_bit_identically(token_files, tmp_path,
                                                                                 uninterrupted):
    _trials(token_files, tmp_path, uninterrupted, list(range(100, 120)))
