"""`python tests/runtime/paused_train.py train ...`: `megatrain train ...` that pauses where
MEGATRAIN_TEST_PAUSE_AT says, so a test can SIGKILL the run there (test_resume_kill.py, test_preempt.py,
test_distributed.py).

`optimizer:K` pauses the host optimizer after the first unit of step K (1-based) has stepped; `checkpoint:K`
pauses the save of checkpoint K after its first file, whether written between steps or while the next step
trains (runtime/checkpoint_stream.py: the disk stream pauses; its first file is the first unit stepped). Either prints `megatrain-test: paused at ...` to stderr
and sleeps. A bad value fails the run from inside the Trainer, so under torchrun the other ranks hear of it.
"""

import os
import sys
import time

from megatrain.cli import main
from megatrain.runtime import checkpoint, sharded_checkpoint
from megatrain.runtime.checkpoint_stream import CheckpointStream
from megatrain.runtime.store import HostStore
from megatrain.runtime.trainer import Trainer

ENV = "MEGATRAIN_TEST_PAUSE_AT"


def pause_here(where: str) -> None:
    print(f"megatrain-test: paused at {where}", file=sys.stderr, flush=True)
    time.sleep(3600)


def pause_at(text: str) -> None:
    """Install the pause `text` names (optimizer:K or checkpoint:K)."""
    where, _, k = text.partition(":")
    if where not in ("optimizer", "checkpoint") or not k.isdigit():
        raise ValueError(f"{ENV}={text!r}: expected optimizer:STEP or checkpoint:STEP (a test hook)")
    step = int(k)
    if where == "optimizer":
        step_unit = HostStore.step_unit

        def pausing(self, unit, lr, index=-1, *rest, **kw):
            step_unit(self, unit, lr, index, *rest, **kw)
            if index + 1 == step:
                pause_here(f"optimizer:{step} after {unit}")

        HostStore.step_unit = pausing
        return

    def pausing_save(save):
        def saving(root, at, *rest, **kw):
            if at == step:
                kw["after_file"] = lambda name: pause_here(f"checkpoint:{step} after {name}")
            return save(root, at, *rest, **kw)
        return saving

    checkpoint.save_checkpoint = pausing_save(checkpoint.save_checkpoint)
    sharded_checkpoint.save = pausing_save(sharded_checkpoint.save)
    save_unit = CheckpointStream._save_unit

    def saving_unit(self, job, unit):
        save_unit(self, job, unit)
        if job.step == step and len(job.files) == 1:
            pause_here(f"checkpoint:{step} after {next(iter(job.files))}")

    CheckpointStream._save_unit = saving_unit


def install() -> None:
    text = os.environ.get(ENV)
    if not text:
        return
    build = Trainer.__init__

    def building(self, *a, **kw):
        Trainer.__init__ = build
        pause_at(text)
        build(self, *a, **kw)

    Trainer.__init__ = building


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
