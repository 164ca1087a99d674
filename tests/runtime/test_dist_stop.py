"""Under torchrun, a signal or a dead peer ends every rank within seconds, each saying in one line what
happened (issue 41): the ranks vote on stopping after each step and only the vote decides, a rank stopped by a
signal exits at once after its stop checkpoint, and a peer whose process is gone is named at once rather than
after seconds of missed heartbeats (or torchrun's SIGKILL 30 s later).

The processes are launched as torchrun launches its workers (dist_helpers.rank_env), and signalled as its agent
does: SIGTERM to every worker when it is itself stopped, and to the others when one of them dies (reaped at once).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from dist_helpers import TIMEOUT_S, free_port, rank_env

from megatrain.runtime.signals import stop_vote

PROMPT_S = 10.0  # "within a few seconds", with room for a loaded test machine


def _argv(*extra) -> list[str]:
    """A long 2-rank run with torchrun's default collective timeout (600 s: a peer is silent 30 s before
    its heartbeat says it is dead)."""
    return [sys.executable, "-m", "megatrain", "train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB",
            "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--dtype", "fp32", "--steps", "2000",
            "--no-progress", *extra]


def _start(argv, tmp_path) -> list[subprocess.Popen]:
    """Two ranks of `argv`, returned once rank 0 has started training (and a second has passed)."""
    port = free_port()
    procs = [subprocess.Popen(argv, env=rank_env(r, 2, port, MEGATRAIN_CACHE=str(tmp_path / "cache")),
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    for line in procs[0].stdout:
        if "params streamed" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    return procs


def _finish(procs) -> list[tuple[int, float, list[str]]]:
    """Each rank's (exit code, seconds until it exited, its `error:` lines); none is left running."""
    t0, out = time.monotonic(), []
    try:
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT_S)
            out.append((p.returncode, time.monotonic() - t0, [x for x in err.splitlines() if x.startswith("error:")]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return out


def test_sigterm_stops_every_rank_after_one_step_and_each_exits_at_once(tmp_path):
    ck = tmp_path / "ck"
    procs = _start(_argv("--checkpoint-every", "100000", "--checkpoint-dir", str(ck)), tmp_path)
    for p in procs:  # torchrun's agent, stopped, sends every worker SIGTERM
        p.send_signal(signal.SIGTERM)
    results = _finish(procs)
    steps = set()
    for rank, (code, took, errors) in enumerate(results):
        assert code == 128 + signal.SIGTERM and took < PROMPT_S, (rank, code, took, errors)
        (line,) = errors
        assert line.startswith(f"error: rank {rank}: stopped by SIGTERM after step ") and "checkpoint" in line, line
        steps.add(line.split("after step ")[1].split(":")[0])
    (step,) = steps  # the same step on both ranks, and its checkpoint whole
    manifest = json.loads((ck / f"step-{int(step):08d}" / "manifest.json").read_text())
    assert manifest["step"] == int(step) and all((ck / f"step-{int(step):08d}" / f).is_file() for f in manifest["files"])


def test_a_killed_peer_is_named_at_once_under_torchruns_defaults(tmp_path):
    """Rank 1 is SIGKILLed; as torchrun's agent does, it is reaped and rank 0 gets SIGTERM at once: rank 0
    names rank 1 in one line and exits within seconds (it waited for 30 s of missed heartbeats before)."""
    procs = _start(_argv(), tmp_path)
    procs[1].kill()
    procs[1].wait()
    procs[0].send_signal(signal.SIGTERM)
    (code, took, errors), _ = _finish(procs)
    assert code == 2 and took < PROMPT_S, (code, took, errors)
    (line,) = errors
    assert "rank 1 stopped: its process" in line and "is gone" in line and "rank 0 stops" in line, line


class _Voting:
    """A communicator whose stop vote is in flight while a signal lands on this rank."""

    def __init__(self, got: list[int], others: bool = False):
        self.got, self.others = got, others

    def any(self, flag: bool, what: str = "") -> bool:
        self.got.append(signal.SIGTERM)  # the handler ran while the collective was in flight
        return flag or self.others


def test_only_the_vote_decides_a_stop():
    """A signal landing during the vote counts at the next step's: a rank that stopped on it alone left the
    others in the next step's collectives (both ranks hung until torchrun's SIGKILL)."""
    got: list[int] = []
    assert stop_vote(got, _Voting(got)) is None and got == [signal.SIGTERM]
    assert stop_vote(got, _Voting(got)) == signal.SIGTERM  # the next step's vote carries it
    assert stop_vote([], _Voting([], others=True)) == signal.SIGTERM  # another rank's signal stops this one too
    assert stop_vote([signal.SIGINT]) == signal.SIGINT and stop_vote([]) is None  # one process: no vote
