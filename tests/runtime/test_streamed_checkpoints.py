"""Checkpoints written while training goes on (runtime/checkpoint_stream.py, planner/checkpoint_writes.py): the
files are the synchronous save's, bit for bit; a fault or a full disk seals nothing and loses nothing; resume
is exact. The SIGKILL trials are in test_streamed_kills.py."""

import errno
import hashlib
import json
import shutil

import pytest
from checkpoint_helpers import SPEC, assert_same_state, make, snapshot

from megatrain.runtime.checkpoint import CheckpointError, read_manifest, step_dirs
from megatrain.runtime.engine import Engine
from megatrain.runtime.trainer import NumericalFault


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


def digests(root) -> dict:
    """Per checkpoint: every file's sha256 and the manifest's, less its creation time (and so its own hash)."""
    out = {}
    for step, path in step_dirs(root):
        m = read_manifest(path)
        body = {k: v for k, v in m.items() if k not in ("created", "manifest_sha256")}
        out[step] = {**{name: f["sha256"] for name, f in m["files"].items()},
                     "manifest": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(),
                     "on_disk": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                 for p in path.iterdir() if p.name != "manifest.json"}}
    return out


def test_streamed_checkpoints_are_the_synchronous_ones_bit_for_bit(token_files, tmp_path):
    root = tmp_path / "ck"
    kw = dict(checkpoint_dir=root, checkpoint_every=1, keep_checkpoints=10)
    with make(token_files, **kw) as t:
        assert t._writing_program is not None and t.checkpoint_note == ""
        t.run(3, progress=False)
        streamed_state = snapshot(t.store)
    streamed = digests(root)
    shutil.rmtree(root)
    with make(token_files, **kw) as t:
        t._writing_program = None  # the same run, every checkpoint written between steps
        t.run(3, progress=False)
        assert_same_state(snapshot(t.store), streamed_state)
    assert sorted(streamed) == [1, 2, 3]
    assert streamed == digests(root)  # so a streamed one resumes as exactly as a synchronous one


def test_the_disk_stream_only_reads_the_store(token_files, tmp_path, monkeypatch):
    """A streamed write takes the units' views with no side effect (HostStore.state_views): it never marks a
    unit's bf16 copy stale nor drops its overflow bound, which would cost the next step a recast and a pass
    over the unit's masters for every unit a checkpoint writes."""
    import threading

    from megatrain.runtime.store import HostStore

    touched = []
    for name in ("state_tensors", "_invalidate"):
        original = getattr(HostStore, name)

        def spy(self, *a, _o=original, _n=name, **kw):
            if threading.current_thread() is not threading.main_thread():
                touched.append(_n)
            return _o(self, *a, **kw)

        monkeypatch.setattr(HostStore, name, spy)
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1) as t:
        t.run(3, progress=False)
        invalidated = [u for u in t.store.units if u in getattr(t.store.feed, "stale", ())]
    assert len(step_dirs(tmp_path)) >= 2 and touched == [] and invalidated == []


def test_a_fault_seals_nothing_from_its_step_and_the_last_checkpoint_stays(token_files, tmp_path, monkeypatch):
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1) as t:
        t.run(2, progress=False)
        at_two = snapshot(t.store)
        original = Engine._write_grads

        def poisoned(self, u, grad_slot, grads, accumulate):  # step 3's gradients of blocks.1: NaN
            original(self, u, grad_slot, grads, accumulate)
            if self.step_index == 2 and u.name == "blocks.1":
                self.bufs[f"grad{grad_slot}"][: u.flat_numel].fill_(float("nan"))

        monkeypatch.setattr(Engine, "_write_grads", poisoned)
        with pytest.raises(NumericalFault, match=r"^step 3: the gradients .* not finite") as info:
            t.run(3, progress=False)  # step 4 writes checkpoint 3 while it trains: it must not be sealed
    assert [s for s, _ in step_dirs(tmp_path)] == [1, 2]
    assert f"{tmp_path / 'step-00000002'}, is intact" in str(info.value)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step-")]
    with make(token_files, resume=tmp_path) as t:
        assert_same_state(snapshot(t.store), at_two)


def test_a_full_disk_while_streaming_is_one_line_and_keeps_the_previous(token_files, tmp_path, monkeypatch):
    import megatrain.runtime.tensorfiles as tensorfiles

    real = tensorfiles.os.fsync

    def full_at_checkpoint_three(fd):
        if list(tmp_path.glob(".step-00000003.tmp-*")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1) as t:
        monkeypatch.setattr(tensorfiles.os, "fsync", full_at_checkpoint_three)
        with pytest.raises(CheckpointError, match=r"^cannot write checkpoint .*step-00000003: No space left on "
                                                  r"device; the last checkpoint, .*step-00000002, is intact"):
            t.run(5, progress=False)
        monkeypatch.undo()
        assert t.step == 4  # the error surfaced once the step writing it had ended
    assert [s for s, _ in step_dirs(tmp_path)] == [1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step-")]


def test_the_writes_overlap_the_step(token_files, tmp_path):
    """With every step a checkpointing one, the disk stream's writes run beside the step's compute."""
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1) as t:
        t.engine.start_timeline()
        t.run(3, progress=False)
        spans = t.engine.measured_spans()
    disk = [s for s in spans if s[0] == "disk" and s[1].startswith("save_state")]
    compute = [s for s in spans if s[0] == "compute" and s[1].startswith(("forward", "backward"))]
    assert len(disk) == 2 * 6  # steps 2 and 3 wrote checkpoints 1 and 2; the last one is written after the run
    assert any(c[3] < d[4] and d[3] < c[4] for d in disk for c in compute)


def _device_units_stream_as_synchronous(token_files, tmp_path, target: str, device: str, hardware, budget: int,
                                        **run_kw):
    """blocks.0 and blocks.1 stepped on `device` (traced for `target`): a run writing a checkpoint every step gives the files, and the
    state, of the same run saving between steps."""
    from checkpoint_helpers import TINY

    from megatrain.planner import plan
    from megatrain.planner.loading import trace_model
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    p = plan(trace_model(TINY, 2, 64, "float32", target), hardware, SPEC, budget,
             resident={"blocks.0": "device", "blocks.1": "device"})
    root = tmp_path / "ck"

    def trainer():
        return Trainer(RunConfig(model=TINY, train=SPEC, gpu_mem=budget, device=device, data=token_files[0],
                                 checkpoint_dir=root, checkpoint_every=1, keep_checkpoints=10), plan=p)

    with trainer() as t:
        assert t._writing_program is not None
        t.run(3, progress=False, **run_kw)
        state = snapshot(t.store)
    streamed = digests(root)
    shutil.rmtree(root)
    with trainer() as t:
        t._writing_program = None
        t.run(3, progress=False, **run_kw)
        assert_same_state(snapshot(t.store), state)
    assert sorted(streamed) == [1, 2, 3] and streamed == digests(root)


def test_units_whose_state_lives_on_the_device_are_streamed_bit_for_bit(token_files, tmp_path):
    _device_units_stream_as_synchronous(token_files, tmp_path, "cpu", "sim", "cpu", 16 * 2**20)


@pytest.mark.cuda
def test_on_cuda_device_units_are_pulled_on_a_stream_of_their_own_and_written_bit_for_bit(token_files, tmp_path):
    """The CUDA path (on a GPU, or the fake backend of `make test-cuda-fake`, which checks the stream protocol):
    a unit on the device is copied into its mirror on the disk thread's own stream after the program's wait."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (or MEGATRAIN_FAKE_CUDA=1)")
    from megatrain.planner import hardware_preset

    _device_units_stream_as_synchronous(token_files, tmp_path, "cuda", "cuda", hardware_preset("h100-sxm"), 2 * 2**30,
                                        handle_signals=False)


def test_the_probe_measures_checkpoint_writes_where_they_go_and_leaves_nothing(tmp_path):
    from megatrain.runtime.machine_probe import disk_rates

    rate, latency, note = disk_rates(tmp_path / "not" / "yet", 4 << 20)  # measured in its nearest folder
    assert rate > 0 and latency >= 0 and f"of 4 MiB in {tmp_path}" in note
    assert "write + sha256 + fsync" in note  # the writer hashes every byte on its thread: the rate includes it
    assert list(tmp_path.iterdir()) == []
