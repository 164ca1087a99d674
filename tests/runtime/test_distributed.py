"""Data parallelism on real processes (gloo on localhost, sim devices): R-rank training is 1-rank training over
the same global batch, the host holds what the plan says per rank, a dead or failing rank stops the others
with one line naming it, and sharded checkpoints resume at the same world size bit for bit and at another one
with equal weights.

Why some comparisons are bit-exact: with one micro-batch per rank and no clipping, every gradient element is
a sum of the same R terms (R <= 2: a + b == b + a exactly) and AdamW is elementwise, so 2-rank training is
bit-identical to eager training; the tests assert that. With more micro-batches per rank the sums associate
differently (each rank's partial sum first), and with clipping the global norm adds slices' squares in
another order (megatrain/runtime/sharded_store.py), so those agree to fp32 round-off. Under AdamW that is not an
elementwise 1e-6: an element whose gradient is a sum that nearly cancels is divided by its own (round-off
dominated) magnitude, so reordering the same sums moves it by up to a fraction of one step's update. Eager
training against itself with the micro-batches of each step reversed (the 3-layer tiny model, 3 steps, lr
2e-3) moves 1 element in 619,392 past 1e-6 + 1e-5 |w|, by 1.2e-6; so these tests ask every element to be
within 1e-5 (a lost, doubled or misplaced gradient moves most elements by ~lr = 2e-3) and at most 1 in 10^5
past 1e-6 + 1e-5 |w|; the 2-rank losses and the bit-exact case stay exact.

Every process is bounded (dist_helpers.TIMEOUT_S, --dist-timeout), ports are free ones, outputs in tmp_path.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import TIMEOUT_S, free_port, rank_env, run_ranks
from dist_workers import config_of, global_batches

from megatrain.models import ModelConfig
from megatrain.planner import TrainSpec
from megatrain.runtime.reference import EagerTrainer

MIB = 2**20
ATOL_MAX = 1e-5  # 0.5% of one step's update at lr 2e-3; a lost or doubled gradient moves most weights by ~lr
OUTLIERS = 1e-5  # of the elements: eager training itself moves 1 in 600k by 1.2e-6 when its micro-batches run
# in reverse order (an element whose gradient sum cancels: AdamW divides it by its own magnitude)


def _train(grad_accum: int, clip: float | None, seq_len: int = 32) -> dict:
    return TrainSpec(micro_batch=2, seq_len=seq_len, grad_accum=grad_accum, dtype="fp32", lr=2e-3, warmup_steps=1,
                     total_steps=3, weight_decay=0.1, clip_norm=clip).model_dump()


def _eager(config: dict, train: dict, batches, policy: str = "exact"):
    eager = EagerTrainer(ModelConfig.model_validate(config), TrainSpec.model_validate(train), host_policy=policy)
    losses = [eager.step(b) for b in batches]
    return eager.model, losses


def _assert_trained_alike(result: dict, model, losses, bit_exact: bool) -> None:
    """Losses to 1e-6; weights bit for bit, or to fp32 round-off as Adam sees it (the module docstring): every
    element within ATOL_MAX, and no more than OUTLIERS of them beyond 1e-6 + 1e-5 |w|."""
    assert result["losses"] == pytest.approx(losses, rel=1e-6)
    master = result["master"]
    assert sorted(master) == sorted(n for n, _ in model.named_parameters())
    total = outliers = 0
    for name, param in model.named_parameters():
        want = param.detach()
        if bit_exact:
            assert torch.equal(master[name], want), f"{name} differs beyond bit-exactness"
        d = (master[name] - want).abs()
        assert float(d.max()) <= ATOL_MAX, f"{name} differs by {float(d.max()):.3g}"
        outliers += int((d > 1e-6 + 1e-5 * want.abs()).sum())
        total += want.numel()
    assert outliers <= OUTLIERS * total, f"{outliers} of {total} elements beyond fp32 round-off"
    for name, buf in model.named_buffers():
        torch.testing.assert_close(result["buffers"][name], buf.float(), rtol=1e-5, atol=1e-6, msg=name)


def _scenario(tmp_path, nproc: int, config: dict, train: dict, budget: int, delays=None, dense=True,
              collectives=("all_gather", "reduce_scatter"), policy: str = "exact"):
    batches = global_batches(config, train, 3)
    results = run_ranks("dist_workers:streamed", nproc, tmp_path, config=config, train=train, budget=budget,
                        batches=batches, delays=delays, policy=policy)
    model, losses = _eager(config, train, batches, policy)
    for r, res in enumerate(results):
        assert res["host_bytes"] == res["plan_host_bytes"][r], f"rank {r} allocated other host bytes than planned"
        assert res["master"].keys() == results[0]["master"].keys()
        assert all(torch.equal(res["master"][k], results[0]["master"][k]) for k in res["master"])  # one model
        if dense:  # MoE plans are an upper bound on the device (test_moe_exactness.py)
            assert res["peak"] == res["plan_peak"]
    assert results[0]["collectives"] == list(collectives)
    return results[0], model, losses


def test_two_ranks_train_as_one_over_the_global_batch(tmp_path):
    """Dense, 2 ranks: one micro-batch each without clipping (bit-exact), two each with clipping and random
    stream delays (fp32 round-off)."""
    config = config_of(n_layers=2)
    for grad_accum, clip, delays, exact in ((2, None, None, True), (4, 1.0, (0.0, 0.002), False)):
        train = _train(grad_accum, clip)
        result, model, losses = _scenario(tmp_path, 2, config, train, 6 * MIB, delays)
        _assert_trained_alike(result, model, losses, bit_exact=exact)


@pytest.mark.slow
def test_two_ranks_under_the_bf16_policy_train_as_one_bit_for_bit(tmp_path):
    """bf16 moments and gradients, 2 ranks of one micro-batch each, no clipping: bit-identical to eager training
    under the policy, so the stochastic rounding of a shard's slices (some starting mid-parameter) drew the
    whole parameter's bits for its elements (host_adamw.Moments.origin)."""
    train = _train(2, None)
    result, model, losses = _scenario(tmp_path, 2, config_of(n_layers=2), train, 6 * MIB, policy="bf16")
    _assert_trained_alike(result, model, losses, bit_exact=True)


def test_two_ranks_with_a_tied_head(tmp_path):
    """The tied embedding and head are replicated units whose host layout leaves the shared weight at its
    owner (UnitIR.host_params): every rank allocates what the plan says and ends with the eager model."""
    config = config_of(n_layers=2, tie_embeddings=True)
    train = _train(2, 1.0)
    # the replicated units' gradients are all-reduced, the sharded blocks' reduce-scattered
    result, model, losses = _scenario(tmp_path, 2, config, train, 6 * MIB,
                                      collectives=("all_gather", "all_reduce", "reduce_scatter"))
    _assert_trained_alike(result, model, losses, bit_exact=False)


RESIDENT = {"blocks.0": "device", "blocks.1": "weights"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype, grad_accum, clip", [("fp32", 4, 1.0), ("bf16", 4, 1.0)])
def test_two_ranks_with_resident_units_train_as_one(tmp_path, dtype, grad_accum, clip):
    """A unit stepped on the device steps its rank's shard and all-gathers its slot after; a unit keeping its
    weights loads its shard once a step: with two micro-batches per rank and clipping, fp32 equals eager
    training to fp32 round-off and bf16 the 2-rank streamed run bit for bit."""
    config, train = config_of(n_layers=2), {**_train(grad_accum, clip), "dtype": dtype}
    batches = global_batches(config, train, 3)
    res = run_ranks("dist_workers:streamed", 2, tmp_path, config=config, train=train, budget=6 * MIB,
                    batches=batches, resident=RESIDENT)
    for r in res:
        assert r["host_bytes"] == r["plan_host_bytes"][r["rank"]] and r["peak"] == r["plan_peak"]
        assert all(torch.equal(r["master"][k], res[0]["master"][k]) for k in r["master"])  # one model
    if dtype == "fp32":
        model, losses = _eager(config, train, batches)
        _assert_trained_alike(res[0], model, losses, bit_exact=False)
        return
    ref = run_ranks("dist_workers:streamed", 2, tmp_path, config=config, train=train, budget=6 * MIB,
                    batches=batches)[0]
    assert res[0]["losses"] == ref["losses"]
    assert all(torch.equal(res[0]["master"][k], ref["master"][k]) for k in ref["master"])


# the cpu preset with a host whose AdamW is slow enough to bind: auto keeps units' state on the (sim) device
SLOW_HOST = {"name": "cpu-slow-host", "host_memory_bytes_per_s": 1e8}


def test_two_ranks_with_auto_resident_units_train_as_eager_bit_for_bit(tmp_path):
    """resident="auto" in a world of 2: the residency pass chooses device units (each rank stepping its shard),
    and one micro-batch per rank without clipping trains bit for bit as eager training over the global batch."""
    config, train = config_of(n_layers=2), _train(2, None)
    batches = global_batches(config, train, 3)
    res = run_ranks("dist_workers:streamed", 2, tmp_path, config=config, train=train, budget=6 * MIB,
                    batches=batches, resident="auto", hardware=SLOW_HOST)
    places = res[0]["state_place"]
    assert "device" in places.values(), places
    for r in res:
        assert r["state_place"] == places
        assert r["host_bytes"] == r["plan_host_bytes"][r["rank"]] and r["peak"] == r["plan_peak"]
        assert all(torch.equal(r["master"][k], res[0]["master"][k]) for k in r["master"])  # one model
    model, losses = _eager(config, train, batches)
    _assert_trained_alike(res[0], model, losses, bit_exact=True)


def test_a_sharded_checkpoint_of_resident_units_resumes_bit_for_bit(tmp_path):
    """2 ranks with a device unit (stepping its shard, all-gathering its slot) and a weights unit (its shard
    loaded once a step), one micro-batch each and no clipping, train bit for bit as eager training (so as the
    2-rank streamed run); they save a sharded checkpoint (the device unit's shard through its mirror) and resume
    it in a fresh store and engine: every rank's state after the next step is the uninterrupted run's bit for bit.
    An evaluation between the steps sees the weights the next step's loss does."""
    config, train = config_of(n_layers=2), _train(2, None)
    batches = global_batches(config, train, 3)
    res = run_ranks("dist_workers:resident_resume", 2, tmp_path, config=config, train=train, budget=6 * MIB,
                    batches=batches, resident=RESIDENT, ckpt=str(tmp_path / "ckpt"))
    model, losses = _eager(config, train, batches)
    _assert_trained_alike(res[0], model, losses, bit_exact=True)
    assert res[0]["val"] == pytest.approx(losses[-1], rel=1e-5)  # the evaluation reads the gathered weights
    for r in res:
        assert r["resident"] == RESIDENT
        assert r["whole"].keys() == r["resumed"].keys()
        for k, t in r["whole"].items():
            assert torch.equal(r["resumed"][k], t), f"{k} differs after the resume"
        assert all(torch.equal(r["resumed_master"][k], t) for k, t in r["master"].items())


def _case(case: str) -> tuple[dict, int]:
    """The model of a case (3 layers) and its device budget."""
    if case == "moe-et":
        from megatrain.models import preset

        base = preset("moe-tiny")
        config = ModelConfig(**{**base.model_dump(), "n_layers": 3, "moe": {
            **base.moe.model_dump(), "router": "et", "warmup_steps": 1, "capacity_factor": 0.25}}).model_dump()
        return config, 24 * MIB
    return config_of(n_layers=3, **({"depth_mixing": case} if case != "dense" else {})), 6 * MIB


@pytest.mark.parametrize("case", ["dense", pytest.param("depthssd:4", marks=pytest.mark.slow),
                                  pytest.param("moe-et", marks=pytest.mark.slow)])
def test_three_ranks_train_as_one(tmp_path, case):
    """3 ranks (shards that cut parameters mid-way), with clipping: dense, a depth mixing, MoE with its routing
    buffers updated from every rank's records."""
    config, budget = _case(case)
    train = _train(3, 1.0)
    result, model, losses = _scenario(tmp_path, 3, config, train, budget, dense=case != "moe-et")
    _assert_trained_alike(result, model, losses, bit_exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("case, grad_accum", [("dense", 8), ("depthssd:4", 4), ("moe-et", 4)])
def test_four_ranks_train_as_one(tmp_path, case, grad_accum):
    """4 ranks with clipping: dense with two micro-batches per rank, a depth mixing and MoE with one each."""
    config, budget = _case(case)
    train = _train(grad_accum, 1.0)
    result, model, losses = _scenario(tmp_path, 4, config, train, budget, dense=case != "moe-et")
    _assert_trained_alike(result, model, losses, bit_exact=False)


# -- failures ----------------------------------------------------------------------------------------------------
def _train_argv(tmp_path, *extra) -> list[str]:
    """`megatrain train` through paused_train.py, which pauses where MEGATRAIN_TEST_PAUSE_AT says."""
    return [sys.executable, str(Path(__file__).with_name("paused_train.py")), "train", "--model", "tiny", "--device",
            "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--dtype", "fp32",
            "--steps", "6", "--no-progress", "--dist-timeout", "20", *extra]


def _ranks(argv, tmp_path, pause_rank1: str | None = None, argv1=None) -> list[subprocess.Popen]:
    """Two ranks of `argv` (rank 1 runs `argv1` if given)."""
    port = free_port()
    cache = {"MEGATRAIN_CACHE": str(tmp_path / "cache")}
    return [subprocess.Popen(argv1 if r == 1 and argv1 else argv, env=rank_env(r, 2, port, **cache, **(
        {"MEGATRAIN_TEST_PAUSE_AT": pause_rank1} if r == 1 and pause_rank1 else {})), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]


def _outputs(procs) -> list[tuple[str, str]]:
    """Each rank's (stdout, stderr) once it exits (or TIMEOUT_S); none is left running."""
    try:
        return [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _kill_rank1_when_paused(procs) -> str:
    """SIGKILL rank 1 once it says it paused (or after TIMEOUT_S); rank 0's stderr once it has exited."""
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for line in procs[1].stderr:
            if "megatrain-test: paused at" in line or time.monotonic() > deadline:
                break
        procs[1].send_signal(signal.SIGKILL)
        return procs[0].communicate(timeout=TIMEOUT_S)[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_killed_rank_stops_the_others_within_the_timeout(tmp_path):
    """Rank 1 is SIGKILLed inside its host optimizer (the others wait for it in a collective): rank 0 ends
    with exit code 2 and one line naming rank 1, and the line is the heartbeat watchdog's verdict (a peer
    silent for dead_after_s = 3 s), not the 20 s collective timeout's."""
    procs = _ranks(_train_argv(tmp_path), tmp_path, pause_rank1="optimizer:2")
    err = _kill_rank1_when_paused(procs)
    assert procs[0].returncode == 2, err[-3000:]
    (line,) = _errors(err)
    assert "rank 1 stopped: no heartbeat" in line and "rank 0 stops" in line, line
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_hung_rank_is_named_when_the_collective_times_out(tmp_path):
    """Rank 1 hangs inside its host optimizer, alive (its heartbeat goes on): rank 0's collective times out
    after --dist-timeout and it stops with one line naming rank 1 as the one that never arrived; rank 1, left
    alone, stops too (its watchdog finds rank 0 gone) instead of sleeping on."""
    procs = _ranks(_train_argv(tmp_path, "--dist-timeout", "8"), tmp_path, pause_rank1="optimizer:2")
    outs = _outputs(procs)
    assert [p.returncode for p in procs] == [2, 2], outs[0][1][-3000:]
    (line,) = _errors(outs[0][1])
    assert "rank 1 did not reach a collective within 8 s" in line and "rank 0 stops" in line, line
    assert "Traceback" not in outs[0][1]
    (theirs,) = _errors(outs[1][1])
    assert "rank 1 stops" in theirs, theirs


@pytest.mark.slow
def test_a_rank_killed_while_saving_loses_no_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed after writing the first file of the step-4 checkpoint: rank 0 stops with one line
    naming rank 1; the step-2 checkpoint is whole, no step-4 folder (nor a half-written one) is visible, and a
    new 2-rank run resumes from step 2 and finishes."""
    ckpt = tmp_path / "ckpt"
    argv = _train_argv(tmp_path, "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt))
    procs = _ranks(argv, tmp_path, pause_rank1="checkpoint:4")
    err = _kill_rank1_when_paused(procs)
    assert procs[0].returncode == 2, err[-3000:]
    (line,) = _errors(err)
    assert "rank 1 stopped" in line and "rank 0 stops" in line, line
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step-00000002"]
    manifest = json.loads((ckpt / "step-00000002" / "manifest.json").read_text())
    assert manifest["step"] == 2 and all((ckpt / "step-00000002" / f).is_file() for f in manifest["files"])
    out = _torchrun(2, [*argv[2:], "--resume", str(ckpt)], tmp_path)
    assert "resumed from" in out and (ckpt / "step-00000006" / "manifest.json").is_file()


def test_a_failing_rank_is_named_by_the_others(tmp_path):
    """Rank 1 raises before training (a bad test-hook value): rank 0 says which rank failed and why."""
    procs = _ranks(_train_argv(tmp_path), tmp_path, pause_rank1="bogus")
    outs = _outputs(procs)
    assert [p.returncode for p in procs] == [2, 2], outs[0][1][-2000:]
    (mine,) = _errors(outs[1][1])
    assert "MEGATRAIN_TEST_PAUSE_AT='bogus'" in mine
    (theirs,) = _errors(outs[0][1])
    assert theirs.startswith("error: rank 1 failed: ValueError: MEGATRAIN_TEST_PAUSE_AT='bogus'"), theirs


def test_ranks_given_different_data_are_refused_before_a_step(tmp_path):
    """Each rank trains on its part of every global batch drawn from one data order: a rank given another
    --data file is named by both before any step or checkpoint (a resume would have refused it only later)."""
    from runtime_schedules import make_token_files

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = make_token_files(tmp_path / "a")[0]
    theirs = make_token_files(tmp_path / "b", phrase="pack my box with five dozen liquor jugs. ")[0]
    ckpt = tmp_path / "ck"
    argv = [_train_argv(tmp_path, "--data", str(data), "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt))
            for data in (ours, theirs)]
    procs = _ranks(argv[0], tmp_path, argv1=argv[1])
    outs = _outputs(procs)
    assert [p.returncode for p in procs] == [2, 2], outs[0][1][-2000:]
    (line,) = _errors(outs[0][1])
    assert "rank 1 reads other data than rank 0" in line and "fingerprint" in line, line
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if p.name.startswith("step-")]


# -- sharded checkpoints -----------------------------------------------------------------------------------------
def _ckpt_argv(data, ckpt, steps=4, *extra) -> list[str]:
    return ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "8MiB", "--seq-len", "32", "--micro-batch",
            "1", "--grad-accum", "6", "--dtype", "fp32", "--steps", str(steps), "--lr", "3e-3", "--warmup", "1",
            "--clip-norm", "1.0", "--data", str(data), "--no-progress", "--checkpoint-every", "2",
            "--checkpoint-dir", str(ckpt), "--dist-timeout", "30", *extra]


def _torchrun(nproc: int, argv: list[str], tmp_path) -> str:
    env = {**rank_env(0, 1, 0, MEGATRAIN_CACHE=str(tmp_path / "cache"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "megatrain", *argv]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, text=True, capture_output=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


def _masters(ckpt) -> dict[str, torch.Tensor]:
    from megatrain.runtime.export import export_weights

    out = ckpt.parent / f"{ckpt.name}-{ckpt.parent.name}.safetensors"
    export_weights(ckpt, out, names="megatrain")
    from safetensors.torch import load_file

    return load_file(out)


@pytest.mark.slow
def test_sharded_checkpoints_resume_at_the_same_and_another_world_size(tmp_path):
    """A 2-rank run launched by torchrun checkpoints at steps 2 and 4 (one manifest, a shard file per rank and
    unit). Resumed from step 2 at 2 ranks, its step-4 checkpoint is byte for byte the uninterrupted one's;
    resumed at 3 ranks, the shards reassemble to exactly the saved weights and training continues to weights
    equal to the uninterrupted run's; a 3-rank checkpoint loads into one rank exactly."""
    from runtime_schedules import make_token_files

    data = make_token_files(tmp_path)[0]
    ref = tmp_path / "ref"
    out = _torchrun(2, _ckpt_argv(data, ref), tmp_path)
    assert "2 rank(s) on 1 node" in out
    step2, step4 = ref / "step-00000002", ref / "step-00000004"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["world"]["nproc"] == 2 and "blocks.0.rank00001.safetensors" in manifest["files"]

    same = tmp_path / "same"
    same.mkdir()
    shutil.copytree(step2, same / step2.name)
    _torchrun(2, _ckpt_argv(data, same, 4, "--resume", str(same)), tmp_path)
    mine, theirs = _tensors(same / step4.name), _tensors(step4)
    assert mine.keys() == theirs.keys()
    for f in theirs:
        assert all(torch.equal(mine[f][k], theirs[f][k]) for k in theirs[f]), f

    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(step2, other / step2.name)
    saved = _masters(step2)
    results = run_ranks("dist_workers:resume_and_train", 3, tmp_path, data=str(data), ckpt=str(other))
    for name, t in saved.items():
        assert torch.equal(results[0]["resumed"][name], t), f"{name} changed when resharded from 2 to 3 ranks"
    final = _masters(step4)
    for name, t in final.items():
        torch.testing.assert_close(results[0]["trained"][name], t, rtol=1e-5, atol=1e-6, msg=name)

    from megatrain.ir.trace import trace
    from megatrain.models import preset
    from megatrain.runtime import checkpoint
    from megatrain.runtime.sharded_checkpoint import load
    from megatrain.runtime.store import HostStore

    three = other / step4.name
    assert json.loads((three / "manifest.json").read_text())["world"]["nproc"] == 3
    ir = trace(preset("tiny"), 1, 32, "fp32", target="cpu")
    one = HostStore(ir, TrainSpec(micro_batch=1, seq_len=32, dtype="fp32"), init=False)
    load(three, checkpoint.read_manifest(three), one)
    got = one.named_master()
    for name, t in _masters(three).items():
        assert torch.equal(got[name], t.view(got[name].shape)), name


def test_torchrun_port_zero_is_refused_in_one_line(monkeypatch):
    """torchrun --master-port 0 hands its workers MASTER_PORT=0: refused at once rather than a join that waits
    for the whole --dist-timeout."""
    from megatrain.runtime.distributed import Communicator

    for k, v in rank_env(0, 2, 0).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="MASTER_PORT=0: torchrun --master-port 0"):
        Communicator.from_env("sim", timeout_s=5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_train_as_two_sim_ranks_over_gloo(tmp_path):
    """The NCCL path (in CI on the fake CUDA backend, its NCCL groups over gloo): 2 GPUs under torchrun train the fp32 tiny model to the
    losses 2 sim ranks over gloo reach, to fp32 round-off of the GPUs' kernels."""
    from runtime_schedules import make_token_files

    data = make_token_files(tmp_path)[0]
    losses = {}
    for device, gpu_mem in (("sim", "8MiB"), ("cuda", "2GiB")):  # a GPU profile reserves 1 GiB
        metrics = tmp_path / f"{device}.jsonl"
        argv = _ckpt_argv(data, tmp_path / f"ckpt-{device}")
        argv[argv.index("--device") + 1], argv[argv.index("--gpu-mem") + 1] = device, gpu_mem
        out = _torchrun(2, [*argv, "--metrics", str(metrics)], tmp_path)
        assert device != "cuda" or "NCCL on CUDA has not been run" in out
        losses[device] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
                          if '"loss"' in line]
    assert losses["cuda"] == pytest.approx(losses["sim"], rel=1e-4)
