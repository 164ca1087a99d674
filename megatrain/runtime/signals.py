"""Preemption: SIGTERM or SIGINT stop a run after the step in flight.

Where it sits: Trainer.run (trainer.py) trains inside `stop_signals()`; after each step it looks at the list,
and when a signal came it drains the device, writes a checkpoint when checkpointing is configured, and
raises `Preempted`. A second signal ends the process at once (the atomic writes leave nothing half-written
under a final name). Under torchrun the ranks vote after each step (`stop_vote`): only the vote decides, so
every rank stops after the same step, a signal that lands during the vote counting at the next one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path


class Preempted(Exception):
    """The run was stopped by a signal after the step in flight (and, when checkpointing is configured, a
    checkpoint of that step was written). `exit_code` is 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        kept = (f"checkpoint {checkpoint} written; resume with --resume {checkpoint.parent}" if checkpoint else
                "no checkpointing was configured, so nothing was saved (--checkpoint-every N keeps one)")
        super().__init__(f"stopped by {name} after step {step}: {kept}")
        self.signum, self.step, self.checkpoint, self.exit_code = signum, step, checkpoint, 128 + signum


@contextlib.contextmanager
def stop_signals(enabled: bool):
    """A list that a first SIGTERM or SIGINT fills with its number; a second one ends the process with that
    signal at once. Handlers are restored afterwards. Only in the main thread (Python's rule for signals)."""
    got: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, frame):
        if got:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        got.append(signum)
        print(f"{signal.Signals(signum).name}: stopping after the step in flight (again to stop at once)",
              file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_vote(got: list[int], comm=None) -> int | None:
    """After a step: the signal to stop on, or None to go on. Under a world (`comm`) the ranks vote, and the
    vote alone decides: `got` is read once, before it, because a signal that lands while the vote is in flight
    fills it on this rank only, and a rank that stopped on it alone would leave the others waiting in the next
    step's collectives (which is how both ranks of a run once hung after SIGTERM)."""
    if comm is None:
        return got[0] if got else None
    if not comm.any(bool(got), "the stop flag"):
        return None
    return got[0] if got else signal.SIGTERM  # another rank was signalled: stop after the same step
