"""Store creation (megatrain/runtime/host_init.py): nothing zero-filled that is written next, zero where zero is the initial
value, the pages touched on several threads when the CPU budget has them, the initial weights unchanged bit for
bit, and the time to the first step predicted by the plan and measured by the Trainer."""

import functools
import json
import math
import threading

import pytest
import torch
from runtime_schedules import make_token_files

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, build_eager, preset
from megatrain.planner import TrainSpec, hardware_preset, plan
from megatrain.planner.creation import store_creation_s
from megatrain.planner.hardware import Hardware
from megatrain.runtime import host_init, host_memory
from megatrain.runtime.store import HostStore

TINY = preset("tiny")
ODD = TINY.model_copy(update={"d_model": 120})  # norm weights of 120 elements: padding in the flat buffers
SPEC = TrainSpec(micro_batch=1, seq_len=16, dtype="fp32")
SENTINEL = 0x7F  # every byte of "fresh" memory in these tests: 3.39e38 as fp32, finite and far from any weight


@functools.cache
def _traced(config_json: str):
    return trace(ModelConfig.model_validate_json(config_json), 1, 16, "fp32", target="cpu")


@pytest.fixture(scope="module")
def ir():
    return _traced(ODD.model_dump_json())


@pytest.fixture
def garbage(monkeypatch):
    """Allocations hold a sentinel instead of the kernel's zeros, as reused memory would: whatever creation does
    not write still holds it."""
    def empty(shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        t.view(-1).view(torch.uint8).fill_(SENTINEL)
        return t

    monkeypatch.setattr(host_memory, "empty", empty)
    return torch.tensor([SENTINEL] * 4, dtype=torch.uint8).view(torch.float32).item()


def _zero(t: torch.Tensor) -> bool:
    return bool((t.view(-1).view(torch.uint8) == 0).all())


@pytest.mark.parametrize("policy", ["exact", "bf16-moments", "fp8"])
def test_masters_are_left_to_what_writes_them_and_the_rest_starts_at_zero(ir, garbage, policy):
    store = HostStore(ir, SPEC, policy=policy, init=False)
    padded = 0
    for st in store.units.values():
        params = torch.cat(st.master_views())
        # only the one byte per page that the touch wrote: the masters were not zero-filled
        assert (params == garbage).float().mean() > 0.99, st.unit.name
        for a, b in host_init.padding(st.master.numel(), st.host):  # nothing writes padding: zero, not garbage
            assert _zero(st.master[a:b])
            padded += b - a
        for mom in st.moments:  # zero is the moments' real initial value
            assert all(_zero(t) for t in mom.tensors().values())
        assert all(float(s) == 0.0 for s in st.steps)
        assert _zero(st.buffers) and _zero(st.norms)
    assert padded > 0  # the case above is exercised


def test_a_store_without_a_program_starts_with_zero_gradients(ir, garbage):
    store = HostStore(ir, SPEC, init=False)
    assert all(_zero(st.grad) for st in store.units.values())


@pytest.mark.parametrize("config", [ODD, TINY.model_copy(update={"tie_embeddings": True})], ids=["padded", "tied"])
def test_initial_weights_are_init_weights_bit_for_bit(garbage, config):
    store = HostStore(_traced(config.model_dump_json()), SPEC, seed=5)
    want = dict(build_eager(config, seed=5).named_parameters())
    got = store.named_master()
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert torch.equal(t, want[name].detach()), name
    again = HostStore(_traced(config.model_dump_json()), SPEC, init=False)
    again.load_state({n: t.detach() for n, t in want.items()})
    assert all(torch.equal(t, got[n]) for n, t in again.named_master().items())


def test_large_buffers_are_created_on_several_threads(ir, monkeypatch):
    """With two threads budgeted and chunks small enough, two threads touch the store at once (the barrier
    holds the first two chunks until both run), and the calling thread's intra-op threads are left as they were."""
    monkeypatch.setattr(host_init, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(host_init, "creation_threads", lambda: 2)
    meet, seen, lock = threading.Barrier(2, timeout=20), set(), threading.Lock()
    zero, touch = host_init.zero_chunk, host_init.touch_chunk

    def recording(fn):
        def run(chunk):
            with lock:
                first = len(seen) < 2 and threading.get_ident() not in seen
                seen.add(threading.get_ident())
            if first:
                meet.wait()
            fn(chunk)
        return run

    monkeypatch.setattr(host_init, "zero_chunk", recording(zero))
    monkeypatch.setattr(host_init, "touch_chunk", recording(touch))
    own = torch.get_num_threads()
    store = HostStore(ir, SPEC, policy="bf16-moments", seed=5)
    assert len(seen) == 2 and threading.get_ident() not in seen
    assert torch.get_num_threads() == own
    st = store.units["blocks.0"]
    assert all(_zero(t) for m in st.moments for t in m.tensors().values())
    want = dict(build_eager(ODD, seed=5).named_parameters())
    assert all(torch.equal(t, want[n].detach()) for n, t in store.named_master().items())


def test_one_budgeted_thread_creates_on_the_calling_thread(ir, monkeypatch):
    monkeypatch.setattr(host_init, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(host_init, "creation_threads", lambda: 1)
    seen = set()
    zero = host_init.zero_chunk
    monkeypatch.setattr(host_init, "zero_chunk", lambda c: (seen.add(threading.get_ident()), zero(c)))
    HostStore(ir, SPEC, init=False)
    assert seen == {threading.get_ident()}


def test_creation_threads_follow_the_cpu_budget(monkeypatch):
    monkeypatch.setattr(host_init.os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    assert host_init.creation_threads() == 3
    monkeypatch.setattr(host_init.os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert host_init.creation_threads() == host_init.MAX_THREADS


def test_plan_predicts_the_time_to_first_step(capsys, ir):
    from megatrain.cli import main

    args = ["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "32", "--micro-batch", "1",
            "--gpu-mem", "8MiB"]
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    hw = hardware_preset("cpu")
    want = got["host_bytes"] / hw.host_touch_bytes_per_s + got["params"] / hw.host_init_params_per_s
    assert got["time_to_first_step_s"] == pytest.approx(want) and want > 0
    assert main(args) == 0
    assert "time to first step" in capsys.readouterr().out
    server = hardware_preset("h100-sxm")  # its assumed rates, on the sim device's profile
    fast = hw.model_copy(update={k: getattr(server, k) for k in ("host_touch_bytes_per_s", "host_init_params_per_s")})
    p = plan(ir, fast, SPEC, "8MiB")
    assert p.time_to_first_step_s == pytest.approx(store_creation_s(fast, p.host_bytes, ir.params_total))
    assert p.time_to_first_step_s < plan(ir, hw, SPEC, "8MiB").time_to_first_step_s


def test_a_profile_without_creation_rates_still_loads():
    data = json.loads(hardware_preset("h100-sxm").to_json())
    del data["host_touch_bytes_per_s"], data["host_init_params_per_s"]
    hw = Hardware.model_validate(data)
    assert math.isfinite(store_creation_s(hw, 2**30, 10**9))


def test_the_trainer_reports_the_time_to_first_step_beside_the_prediction(tmp_path):
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    data = make_token_files(tmp_path)[0]
    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=1)
    with Trainer(RunConfig(model="tiny", train=train, gpu_mem="6MiB", data=data, hardware="cpu", device="sim",
                           metrics=tmp_path / "m.jsonl")) as t:
        t.run(1, progress=False, handle_signals=False)
        assert t.time_to_first_step_s > 0
    (rec,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rec["time_to_first_step_s"] == t.time_to_first_step_s
    assert rec["predicted_time_to_first_step_s"] == t.plan.time_to_first_step_s > 0
