"""A resume read while the first step trains (planner/checkpoint_reads.py, runtime/checkpoint_stream.py
`load_state`): the run is the synchronous resume's and the uninterrupted run's bit for bit, units whose state
lives on the device included; the reads overlap the step; a bad file stops the step in one line and changes
nothing on disk."""

import errno
import shutil
import threading
import time

import pytest
from checkpoint_helpers import SPEC, TINY, assert_same_state, snapshot

from megatrain.runtime.checkpoint import CheckpointError, step_dirs
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

BUDGET = 16 * 2**20
PLACES = {"host": None, "device": {"blocks.0": "device"}}
_PLANS: dict = {}


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


def _plan(place: str):
    if place not in _PLANS:
        from megatrain.planner import plan
        from megatrain.planner.loading import trace_model

        resident = PLACES[place]
        _PLANS[place] = plan(trace_model(TINY, 2, 64, "float32", "cpu"), "cpu", SPEC, BUDGET,
                             **({"resident": resident} if resident else {}))
    return _PLANS[place]


def trainer(token_files, place: str, delays=None, **kw) -> Trainer:
    config = RunConfig(model=TINY, train=SPEC, gpu_mem=BUDGET, device="sim", data=token_files[0], **kw)
    return Trainer(config, plan=_plan(place), delays=delays)


def losses(records) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module", params=list(PLACES))
def uninterrupted(request, token_files, tmp_path_factory):
    """Four steps straight, checkpoint 2 kept: (place, checkpoint 2, its state, the losses of steps 3 and 4,
    the state after step 4)."""
    place, root = request.param, tmp_path_factory.mktemp("ck")
    with trainer(token_files, place, checkpoint_dir=root, checkpoint_every=2) as t:
        t.run(2, progress=False, log_every=1)
        at_two = snapshot(t.store)
        later = losses(t.run(2, progress=False, log_every=1))
        final = snapshot(t.store)
    ckpt = dict(step_dirs(root))[2]
    return place, ckpt, at_two, later, final


def test_a_streamed_resume_is_the_synchronous_one_and_the_uninterrupted_run_bit_for_bit(token_files, uninterrupted):
    place, ckpt, at_two, later, final = uninterrupted
    with trainer(token_files, place, delays=(0.0, 0.001), resume=ckpt) as t:  # delays: a missing wait shows
        job = t._resume_job
        assert job is not None and t.resume_note == ""
        streamed = losses(t.run(2, progress=False, log_every=1))
        assert t._resume_job is None
        device = list(PLACES[place] or ())  # read before the step, the rest during it, in forward order
        assert job.loaded == [*device, *(u.name for u in t.plan.ir.units if u.name not in device)]
        assert_same_state(snapshot(t.store), final)
    assert streamed == later
    with trainer(token_files, place, resume=ckpt) as t:
        assert_same_state(snapshot(t.store), at_two)  # reading the store before the first step reads it all
        assert t._resume_job is None
        assert losses(t.run(2, progress=False, log_every=1)) == later
        assert_same_state(snapshot(t.store), final)


def test_the_reads_overlap_the_first_step(token_files, uninterrupted):
    """The head's file is read only once the embedding's first forward has run (the disk thread holds it back
    until then): a program that read every file before computing would never get there."""
    place, ckpt, _, later, final = uninterrupted
    with trainer(token_files, place, resume=ckpt) as t:
        t.engine.start_timeline()
        computed = threading.Event()

        def hold(unit):  # on the disk thread, before each read
            deadline = time.monotonic() + 60
            while unit == "head" and not computed.is_set():
                if any(s[0] == "compute" and s[1].startswith("forward(embed") for s in list(t.engine.timeline)):
                    computed.set()
                elif time.monotonic() > deadline:
                    raise AssertionError("the embedding's forward never ran before the head's read")
                else:
                    time.sleep(0.005)

        t._resume_job.before_unit = hold
        assert losses(t.run(1, progress=False, log_every=1)) == later[:1]
        spans = t.engine.measured_spans()
    assert computed.is_set()
    head = next(s for s in spans if s[0] == "disk" and s[1] == "load_state(head)")
    embed = next(s for s in spans if s[0] == "compute" and s[1].startswith("forward(embed"))
    assert embed[4] <= head[3]  # the head's read began after the first forward ended


def _folder(ckpt) -> dict:
    return {p.relative_to(ckpt): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


def test_a_flipped_byte_stops_the_first_step_in_one_line_and_changes_nothing(token_files, uninterrupted, tmp_path):
    _, ckpt, *_ = uninterrupted
    bad = tmp_path / ckpt.name
    shutil.copytree(ckpt, bad)
    path = bad / "blocks.1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x01  # inside a tensor: the header and size are fine, only the read's sha256 finds it
    path.write_bytes(bytes(data))
    before = _folder(bad)
    with trainer(token_files, "host", resume=bad) as t:
        assert t._resume_job is not None  # the cheap checks passed: the step finds it
        with pytest.raises(CheckpointError) as info:
            t.run(1, progress=False)
        assert t.device.failed and t.step == 2
    message = str(info.value)
    assert message.startswith(f"{path}: contents do not match the sha256") and "\n" not in message
    assert _folder(bad) == before


def test_an_io_error_is_the_files_one_line_error(token_files, uninterrupted, monkeypatch):
    from megatrain.runtime import tensorfiles

    _, ckpt, *_ = uninterrupted
    before = _folder(ckpt)
    real = tensorfiles.SafetensorsFile.read

    def failing(self, targets, cast=False):
        if self.path.name == "blocks.0.safetensors":
            self.close()
            raise OSError(errno.EIO, "Input/output error")
        return real(self, targets, cast)

    monkeypatch.setattr(tensorfiles.SafetensorsFile, "read", failing)
    with trainer(token_files, "host", resume=ckpt) as t:
        with pytest.raises(CheckpointError, match=r"blocks\.0\.safetensors: cannot be read: Input/output error; "):
            t.run(1, progress=False)
    assert _folder(ckpt) == before


def test_a_header_problem_is_found_before_the_step(token_files, uninterrupted, tmp_path):
    _, ckpt, *_ = uninterrupted
    bad = tmp_path / ckpt.name
    shutil.copytree(ckpt, bad)
    (bad / "head.safetensors").write_bytes((bad / "head.safetensors").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"head\.safetensors: truncated"):
        trainer(token_files, "host", resume=bad)


@pytest.mark.cuda
def test_on_cuda_a_streamed_resume_is_the_synchronous_one_bit_for_bit(token_files, tmp_path):
    """The CUDA path (on a GPU, or the fake backend of `make test-cuda-fake`): the h2d stream's loads wait on the
    disk thread's reads into pinned host memory, a device unit is read before the step and uploaded at its start."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (or MEGATRAIN_FAKE_CUDA=1)")
    from megatrain.planner import hardware_preset, plan
    from megatrain.planner.loading import trace_model

    budget = 2 * 2**30
    p = plan(trace_model(TINY, 2, 64, "float32", "cuda"), hardware_preset("h100-sxm"), SPEC, budget,
             resident={"blocks.0": "device"})

    def cuda_trainer(**kw):
        return Trainer(RunConfig(model=TINY, train=SPEC, gpu_mem=budget, device="cuda", data=token_files[0], **kw),
                       plan=p)

    with cuda_trainer(checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(2, progress=False, handle_signals=False)
    runs = []
    for streamed in (True, False):
        with cuda_trainer(resume=tmp_path) as t:
            assert t._resume_job is not None
            if not streamed:
                t.settle_resume()
            runs.append((losses(t.run(2, progress=False, log_every=1, handle_signals=False)), snapshot(t.store)))
    assert runs[0][0] == runs[1][0]
    assert_same_state(runs[0][1], runs[1][1])
