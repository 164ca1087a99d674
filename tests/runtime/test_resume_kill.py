"""A real kill test: `megatrain train` subprocesses killed with SIGKILL, resumed, bit-identical at the end.

One run is killed during step 5, inside the host optimizer, after the head has stepped and before the other
units have (so the weights in memory are half updated; step 5 writes checkpoint 4 while it trains, which may or
may not be sealed by then); another is killed while writing checkpoint 4, after its first file. Each resumes (`--resume DIR`) from the last complete checkpoint and ends with a step-6
checkpoint whose every tensor, and so every file's sha256, equals an uninterrupted run's.

The kill points come from MEGATRAIN_TEST_PAUSE_AT, which paused_train.py (megatrain train with a pause installed)
reads: the process prints `megatrain-test: paused at ...` and sleeps there until this test kills it. The two scenarios run side
by side with the uninterrupted run (each process mostly imports and traces) to keep the test near 25 s
on 2 cores.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain.runtime.checkpoint import step_dirs

TIMEOUT_S = 240
PAUSED = str(Path(__file__).with_name("paused_train.py"))  # megatrain with the test pause


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"), "pack my box with five dozen liquor jugs. ")[0]


def argv(token_file, ckpt, *extra):
    return ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
            "--micro-batch", "2", "--dtype", "fp32", "--steps", "6", "--lr", "3e-3", "--warmup", "1",
            "--data", str(token_file), "--no-progress", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt),
            "--metrics", str(ckpt.parent / f"{ckpt.name}.jsonl"), *extra]


class Run:
    """A `megatrain train` subprocess whose stderr lines are collected by a thread."""

    def __init__(self, args, tmp_path, pause=None):
        env = {**os.environ, "MEGATRAIN_CACHE": str(tmp_path / "cache")}
        env.pop("MEGATRAIN_TEST_PAUSE_AT", None)
        if pause:
            env["MEGATRAIN_TEST_PAUSE_AT"] = pause
        self.proc = subprocess.Popen([sys.executable, PAUSED, *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def kill_at(self, needle: str) -> None:
        """Wait for the pause line, then SIGKILL the process there."""
        try:
            while True:
                line = self.lines.get(timeout=TIMEOUT_S)
                if line is None:
                    pytest.fail(f"exited ({self.proc.wait()}) before pausing: {''.join(self.err)[-2000:]}")
                if needle in line:
                    break
        finally:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=TIMEOUT_S)
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self) -> str:
        out, _ = self.proc.communicate(timeout=TIMEOUT_S)
        assert self.proc.returncode == 0, "".join(self.err)[-2000:]
        return out


def tensors(ckpt):
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def test_sigkill_mid_step_and_mid_checkpoint_then_resume_is_bit_identical(token_file, tmp_path):
    mid_step, mid_save, ref = tmp_path / "mid_step", tmp_path / "mid_save", tmp_path / "ref"
    runs = [Run(argv(token_file, mid_step), tmp_path, pause="optimizer:5"),
            Run(argv(token_file, mid_save), tmp_path, pause="checkpoint:4"),
            Run(argv(token_file, ref), tmp_path)]  # the uninterrupted run, a fresh process like the others
    runs[0].kill_at("paused at optimizer:5 after head")
    runs[1].kill_at("paused at checkpoint:4 after ")  # written while step 5 trains: the head's file is first
    runs[2].finish()

    kept = [s for s, _ in step_dirs(mid_step)]  # killed in step 5, which writes checkpoint 4 while it trains
    assert kept in ([2, 4], [2])  # so 4 is whole if its seal came before the kill, else 2 is the last
    assert [s for s, _ in step_dirs(mid_save)] == [2]  # killed writing 4: only its temporary folder exists
    assert [p.name for p in mid_save.iterdir() if p.name.startswith(".step-00000004.tmp-")]

    resumed = [Run(argv(token_file, ck, "--resume", str(ck)), tmp_path) for ck in (mid_step, mid_save)]
    outs = [r.finish() for r in resumed]
    assert "resumed from" in outs[0] and f"step-0000000{kept[-1]} at step {kept[-1]} of 6" in outs[0]
    assert "step-00000002 at step 2 of 6" in outs[1]
    assert not [p for p in mid_save.iterdir() if p.name.startswith(".step")]  # the dead save's temporary is gone

    want = tensors(ref / "step-00000006")
    want_manifest = json.loads((ref / "step-00000006" / "manifest.json").read_text())
    ref_losses = losses(tmp_path / "ref.jsonl")
    for ck in (mid_step, mid_save):
        got = tensors(ck / "step-00000006")
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (ck.name, key)
        manifest = json.loads((ck / "step-00000006" / "manifest.json").read_text())
        assert manifest["files"] == want_manifest["files"]  # same bytes, file by file
        assert manifest["data"] == want_manifest["data"]
        got_losses = losses(tmp_path / f"{ck.name}.jsonl")
        assert all(got_losses[s] == ref_losses[s] for s in (5, 6))  # the resumed steps saw the same batches
