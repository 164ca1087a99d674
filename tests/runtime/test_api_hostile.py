"""Bad arguments to the Python API (Trainer, tune) are one ValueError naming the argument and what it takes,
raised before anything changes; the CLI's twin is tests/test_cli_hostile.py."""

import pytest
from runtime_schedules import make_token_files

from megatrain.planner import TrainSpec, tune
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

SPEC = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_token_files(tmp_path_factory.mktemp("d"))


def test_the_budget_may_be_a_size_string_as_plan_takes_it(data):
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem="6MiB", data=data[0], hardware="cpu", device="sim")) as t:
        assert t.plan.gpu_budget_bytes == 6 * 2**20


@pytest.mark.parametrize("kw, message", [
    ({"train": {"micro_batch": 2}}, "train must be a TrainSpec"),
    ({"checkpoint_every": "5"}, "checkpoint_every must be an integer"),
    ({"keep_checkpoints": 2.5}, "keep_checkpoints must be an integer"),
    ({"gpu_mem": "6 XB"}, "cannot read '6 XB' as a byte size"),
    ({"val_data": 5}, "val_data must be a path"),
    ({"checkpoint_dir": __file__, "checkpoint_every": 1}, "is a file, not a folder"),
    ({"host_policy": "int4"}, "unknown host policy 'int4'; use auto or one of exact"),
    ({"host_policy": None}, "host_policy must be 'auto' or a policy's name"),
])
def test_bad_constructor_arguments(data, kw, message):
    args = {"train": SPEC, "gpu_mem": "6MiB", **kw}
    with pytest.raises(ValueError, match=message):
        Trainer(RunConfig(model="tiny", data=data[0], hardware="cpu", device="sim", **args))


def test_a_host_policy_is_read_as_a_user_writes_it(data):
    """Case, surrounding spaces and underscores for hyphens: `BF16_Moments` is bf16-moments, ` AUTO ` auto."""
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem="6MiB", data=data[0], hardware="cpu", device="sim",
                           host_policy="BF16_Moments")) as t:
        assert t.host_policy == t.plan.host_policy == "bf16-moments"
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem="6MiB", data=data[0], hardware="cpu", device="sim",
                           host_policy=" AUTO ")) as t:
        assert t.host_policy == "auto" and t.plan.host_policy == "exact"


def test_run_arguments_are_checked_before_any_step_and_close_is_idempotent(data):
    t = Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem="6MiB", data=data[0], hardware="cpu", device="sim"))
    for args, message in (((-1,), "steps must be an integer >= 0"), (("3",), "steps must be an integer"),
                          ((1.5,), "steps must be an integer"), ((True,), "steps must be an integer"),
                          ((1,), "log_every must be an integer >= 1")):
        kw = {"log_every": 0} if args == (1,) else {}
        with pytest.raises(ValueError, match=message):
            t.run(*args, progress=False, **kw)
        assert t.step == 0  # nothing ran
    with pytest.raises(ValueError, match="eval_every=1 needs validation data"):
        t.run(1, eval_every=1, progress=False)
    assert t.run(0, progress=False) == [] and t.step == 0
    assert len(t.run(2, progress=False)) == 2
    with pytest.raises(ValueError, match="pass the run's total_steps 3"):
        t.run(2, progress=False)  # the learning-rate schedule ends at step 3
    t.close()
    t.close()  # a second close (a context manager exit after close) does nothing
    with pytest.raises(ValueError, match="this Trainer is closed"):
        t.run(1, progress=False)


@pytest.mark.parametrize("kw, message", [
    ({"budgets": "80GiB", "depth_ranks": "16"}, "depth_ranks must be a list of int"),
    ({"budgets": 6 * 2**20, "micro_batches": ["2"]}, "micro_batches must be a list of int"),
    ({"budgets": [None]}, "budgets must be a list of int or str"),
    ({"budgets": ["6MiB"], "micro_batches": [0]}, "micro_batches must be positive"),
])
def test_tune_takes_lists_or_one_value_and_refuses_the_rest(kw, message):
    with pytest.raises(ValueError, match=message):
        tune("tiny", "cpu", SPEC, **kw)


def test_tune_takes_one_budget_alone():
    result = tune("tiny", "cpu", SPEC, "8MiB", micro_batches=2)
    assert [(r.micro_batch, r.gpu_budget_bytes) for r in result.rows] == [(2, 8 * 2**20)]


def test_trace_plan_emit_and_build_eager_name_what_they_take():
    import megatrain

    with pytest.raises(ValueError, match="micro_batch must be an integer, got '2'"):
        megatrain.trace("tiny", "2", 64)
    with pytest.raises(ValueError, match="plan takes a ModelIR"):
        megatrain.plan("tiny", "cpu", SPEC)
    with pytest.raises(ValueError, match="train must be a TrainSpec"):
        megatrain.plan(megatrain.trace("tiny", 2, 64), "cpu", {"micro_batch": 2})
    with pytest.raises(ValueError, match="emit takes a Plan"):
        megatrain.emit(None)
    assert megatrain.build_eager("tiny").config.name == "tiny"  # a preset name, as trace and Trainer take
