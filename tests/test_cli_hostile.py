"""Bad input everywhere in the CLI: one line naming the cause and the fix, exit code 2, no traceback.

A table of the inputs people get wrong (sizes, presets, data files, config files, output paths, checkpoints,
flags), each with what the message must name; `--debug` shows the traceback; and hypothesis feeding random and
hostile values to model config files and to `plan` and `train` arguments: whatever comes in, the CLI exits 0
or answers in one `error:` line, never with an unhandled exception.
"""

import contextlib
import io
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatrain.cli import main

TRAIN = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--steps", "1",
         "--dtype", "fp32", "--no-progress"]


def token_file(path, tokens, dtype="uint16", **meta):
    path.write_bytes(np.asarray(tokens, dtype=np.dtype(dtype) if dtype in ("uint16", "uint32") else "<u2").tobytes())
    side = {"dtype": dtype, "n_tokens": len(tokens), **meta}
    path.with_name(path.name + ".json").write_text(json.dumps(side))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good and hostile inputs on disk."""
    d = tmp_path_factory.mktemp("hostile")
    token_file(d / "good.bin", np.arange(2000) % 256)
    token_file(d / "dtype.bin", np.arange(200) % 256, dtype="float32")
    odd = d / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    (d / "odd.bin.json").write_text(json.dumps({"dtype": "uint16", "n_tokens": 1}))
    token_file(d / "vocab.bin", [1, 2, 300] * 100)
    token_file(d / "short.bin", np.arange(50))
    (d / "nosidecar.bin").write_bytes(b"\x00" * 400)
    (d / "badside.bin").write_bytes(b"\x00" * 400)
    (d / "badside.bin.json").write_text("{not json")
    (d / "bad.json").write_text("{\"base\": \"tiny\",")
    (d / "bad.toml").write_text("d_model = = 3")
    (d / "dir.json").mkdir()
    (d / "field.json").write_text(json.dumps({"base": "tiny", "hidden": 3}))
    (d / "heads.json").write_text(json.dumps({"base": "tiny", "n_heads": 3}))
    (d / "negative.json").write_text(json.dumps({"base": "tiny", "d_model": -128}))
    (d / "locked.json").write_text(json.dumps({"base": "tiny"}))
    os.chmod(d / "locked.json", 0)
    (d / "a_file").write_text("x")
    (d / "ckpt_empty").mkdir()
    (d / "inf.json").write_text('{"base": "tiny", "norm_eps": 1e400}')  # JSON reads 1e400 as inf
    (d / "bool.json").write_text(json.dumps({"base": "tiny", "n_layers": True}))
    from megatrain.planner import hardware_preset

    profile = json.loads(hardware_preset("cpu").to_json())
    (d / "hwzero.json").write_text(json.dumps({**profile, "matmul_flops": {"bfloat16": 0, "float32": 0}}))
    (d / "notes.txt").write_text("my notes, not a metrics log\n")
    (d / "prose.safetensors").write_text("precious")
    (d / "binary.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\xff\xfe" * 50)
    (d / "empty.txt").write_text("")
    record = {"step": 1, "loss": 5.5, "step_time_s": 0.5, "tokens_per_s": 256.0}
    (d / "nullstep.jsonl").write_text(json.dumps(record) + "\n" + json.dumps({**record, "step_time_s": None}) + "\n")
    (d / "strloss.jsonl").write_text(json.dumps({**record, "loss": "abc"}) + "\n")
    return d


def run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def assert_one_line(rc, err, *needles):
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


CASES = {
    # sizes
    "train-size": (["--gpu-mem", "80XB"], ["80XB", "GiB"]),
    "plan-size": (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--gpu-mem", "8 ZB"],
                  ["8 ZB", "80GiB"]),
    "host-mem": (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--host-mem", "lots"],
                 ["lots"]),
    # presets and config files
    "preset": (["--model", "llama-9000"], ["llama-9000", "tiny, small", "llama3-70b"]),
    "config-json": (["--model", "{d}/bad.json"], ["bad.json", "not valid JSON"]),
    "config-toml": (["--model", "{d}/bad.toml"], ["bad.toml", "not valid TOML"]),
    "config-dir": (["--model", "{d}/dir.json"], ["dir.json", "without config.json"]),
    "config-missing": (["--model", "{d}/missing.json"], ["missing.json", "check the path"]),
    "config-field": (["--model", "{d}/field.json"], ["hidden", "valid fields"]),
    "config-heads": (["--model", "{d}/heads.json"], ["n_heads=3", "pick n_heads among"]),
    "config-negative": (["--model", "{d}/negative.json"], ["d_model must be a positive integer"]),
    # data files
    "data-missing": (["--data", "{d}/none.bin"], ["none.bin", "megatrain prepare"]),
    "data-dtype": (["--data", "{d}/dtype.bin"], ["dtype.bin.json", "unknown dtype 'float32'"]),
    "data-odd-size": (["--data", "{d}/odd.bin"], ["odd.bin", "not a whole number of uint16 tokens"]),
    "data-vocab": (["--data", "{d}/vocab.bin"], ["vocab.bin", "token id 300", "vocab_size is 256"]),
    "data-sidecar": (["--data", "{d}/nosidecar.bin"], ["sidecar nosidecar.bin.json is missing"]),
    "data-sidecar-json": (["--data", "{d}/badside.bin"], ["badside.bin.json", "not valid JSON"]),
    "data-short": (["--data", "{d}/short.bin"], ["short.bin", "50 tokens, fewer than seq_len + 1 = 65"]),
    # output paths
    "metrics-under-file": (["--metrics", "{d}/a_file/m.jsonl"], ["--metrics", "is a file, not a folder"]),
    "trace-is-dir": (["--trace", "{d}"], ["--trace", "is a folder"]),
    "checkpoint-dir": (["--checkpoint-every", "1", "--checkpoint-dir", "{d}/a_file/ck"], ["--checkpoint-dir"]),
    "export-out": (["export", "--checkpoint", "{d}/ckpt_empty", "--out", "{d}/a_file/x.safetensors"], ["--out"]),
    "compile-out": (["compile", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--gpu-mem", "6MiB",
                     "-o", "{d}/a_file/step.py"], ["writable"]),
    "prepare-out": (["prepare", "{d}/bad.json", "--out", "{d}/a_file"], ["a_file", "not a folder"]),
    # checkpoints
    "resume-missing": (["--resume", "{d}/nowhere"], ["nowhere", "no such checkpoint folder"]),
    "resume-empty": (["--resume", "{d}/ckpt_empty"], ["holds no checkpoint", "--checkpoint-every"]),
    "export-empty": (["export", "--checkpoint", "{d}/ckpt_empty", "--out", "{d}/x.safetensors"],
                     ["holds no checkpoint"]),
    # flags
    "steps": (["--steps", "0"], ["--steps must be a positive integer"]),
    "log-every": (["--log-every", "0"], ["--log-every"]),
    "lr": (["--lr", "inf"], ["--lr must be a finite number > 0"]),
    "clip": (["--clip-norm", "nan"], ["--clip-norm must be > 0"]),
    "seed": (["--seed", "-1"], ["--seed"]),
    "grad-accum": (["--grad-accum", "0"], ["--grad-accum"]),
    "dtype": (["--dtype", "fp16"], ["fp16", "bf16"]),
    "on-nan": (["--on-nan", "ignore"], ["--on-nan", "abort", "skip"]),
    "keep": (["--keep-checkpoints", "0"], ["--keep-checkpoints"]),
    "device": (["--device", "tpu"], ["--device", "sim"]),
    "hardware": (["--hardware", "abacus"], ["abacus", "h100-sxm", "megatrain probe"]),
    "unknown-flag": (["--gpu-memory", "6MiB"], ["--gpu-memory", "--help"]),
    # flags that would otherwise be ignored or misread
    "checkpoint-dir-alone": (["--checkpoint-dir", "{d}/ck_alone"], ["without --checkpoint-every", "add"]),
    "eval-without-val": (["--eval-every", "1"], ["--eval-every 1", "--val-data"]),
    "warmup-longer-than-run": (["--warmup", "5"], ["--warmup 5 is longer than the run", "--steps 1"]),
    "train-nproc-zero": (["--nproc", "0"], ["--nproc and --nnodes must be positive"]),
    "dist-timeout": (["--dist-timeout", "-5"], ["--dist-timeout"]),
    "plan-nproc-zero": (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--nproc", "0"],
                        ["--nproc and --nnodes must be positive"]),
    "host-mem-zero": (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--host-mem", "0"],
                      ["--host-mem must be a positive size"]),
    "tune-micro-batch": (["tune", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--gpu-mem", "2GiB",
                          "--micro-batch", "1,0"], ["--micro-batch", "greater than 0"]),
    "rank-tolerance": (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--rank-tolerance",
                        "0.2"], ["--rank-tolerance applies to --depth-rank auto"]),
    "probe-without-model": (["probe", "--sim-threads", "2"], ["--sim-threads", "add --model"]),
    "depth-matrix-seed": (["depth-matrix", "--model", "tiny", "--depth-mixing", "depthssd:2", "--seed", "-5"],
                          ["--seed"]),
    # values
    "config-inf": (["--model", "{d}/inf.json"], ["norm_eps", "finite"]),
    "config-bool": (["--model", "{d}/bool.json"], ["n_layers must be an integer, got true"]),
    "profile-zero-flops": (["plan", "--model", "tiny", "--hardware", "{d}/hwzero.json", "--seq-len", "64"],
                           ["hwzero.json", "matmul_flops", "must be a finite FLOP/s > 0", "megatrain probe"]),
    "data-folder": (["--data", "{d}/ckpt_empty"], ["is a folder", "train.bin"]),
    # outputs over files that are not what the command writes
    "metrics-over-prose": (["--metrics", "{d}/notes.txt"], ["notes.txt", "not a metrics log"]),
    "export-over-prose": (["export", "--checkpoint", "{d}/ckpt_empty", "--out", "{d}/prose.safetensors"],
                          ["prose.safetensors", "not a safetensors file"]),
    # inputs that are not what the command reads
    "prepare-binary": (["prepare", "{d}/binary.txt", "--out", "{d}/tok_binary"], ["binary.txt", "binary file"]),
    "prepare-empty": (["prepare", "{d}/empty.txt", "--out", "{d}/tok_empty"], ["empty.txt", "no text"]),
    "report-null": (["report", "{d}/nullstep.jsonl"], ["line 2", "step_time_s must be"]),
    "report-string": (["report", "{d}/strloss.jsonl"], ["line 1", "loss must be a number"]),
    "report-binary": (["report", "{d}/binary.txt"], ["binary.txt", "not a text file"]),
}
COMMANDS = ("plan", "tune", "probe", "export", "compile", "prepare", "report", "depth-matrix")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_naming_cause_and_fix(files, case):
    args, needles = CASES[case]
    args = [a.replace("{d}", str(files)) for a in args]
    argv = args if args[0] in COMMANDS else _train(args, files)
    rc, _, err = run_cli(argv)
    assert_one_line(rc, err, *needles)
    if case == "export-over-prose":
        assert (files / "prose.safetensors").read_text() == "precious"
    if case == "metrics-over-prose":
        assert (files / "notes.txt").read_text() == "my notes, not a metrics log\n"
    if case.startswith("prepare-"):
        assert not (files / f"tok_{case.split('-')[1]}").exists()


@pytest.mark.parametrize("argv, needles", [
    ([*TRAIN, "--model", "moe-tiny", "--compile-units"], ["--compile-units", "MoE", "drop --compile-units"]),
    pytest.param([*TRAIN, "--device", "cuda"], ["--device cuda", "no CUDA device"],
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")),
])
def test_flags_that_cannot_apply_are_refused(files, argv, needles):
    rc, _, err = run_cli([*argv, "--data", str(files / "good.bin")])
    assert_one_line(rc, err, *needles)


def _train(args, files):
    """TRAIN with `args` replacing its flags (and good data unless --data is given)."""
    argv = list(TRAIN)
    if "--data" not in args:
        argv += ["--data", str(files / "good.bin")]
    for flag, value in zip(args[::2], args[1::2]):
        if flag in argv and flag != "--data":
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_config_file(files):
    rc, _, err = run_cli(_train(["--model", str(files / "locked.json")], files))
    assert_one_line(rc, err, "locked.json", "Permission denied")


def test_debug_shows_the_traceback(files):
    rc, _, err = run_cli(["--debug", *_train(["--gpu-mem", "80XB"], files)])
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


# -- hypothesis: random and hostile values ------------------------------------------------------------------
# A valid command line with up to three flags replaced by random or hostile values, so that examples reach every
# stage (parsing, config, data, planning, training) rather than all failing in argparse.
HOSTILE_TEXT = st.sampled_from(["", " ", "-1", "0", "nan", "inf", "-inf", "1e400", "0x10", "１", "\x00", "'; rm -rf /",
                                "{}", "[]", "../../etc", "%s%n", "\u202e", "9" * 40])
INT = st.one_of(st.integers(-3, 4).map(str), HOSTILE_TEXT)
FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), HOSTILE_TEXT)
BYTES = st.one_of(st.sampled_from(["8MiB", "2MiB", "64MiB", "80XB", "0", "1e400GiB", "nanGiB", "1.5", "6 MiB", "6mib",
                                   "3TiB"]), st.text(alphabet="0123456789.eEkKmMgGiIbBtT -", max_size=8), HOSTILE_TEXT)
CONFIG_VALUE = st.one_of(st.integers(-4, 2**20), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                         st.none(), st.text(max_size=4), st.lists(st.integers(0, 8), max_size=2))
FIELDS = ["vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "max_seq_len",
          "init_std", "tie_embeddings", "qkv_bias", "qk_norm", "name", "base", "bogus"]
SMALL_MODEL = st.fixed_dictionaries({
    "vocab_size": st.sampled_from([256, 300, 1, 0]), "d_model": st.sampled_from([16, 32, 24, 7]),
    "n_layers": st.integers(0, 3), "n_heads": st.sampled_from([1, 2, 4, 3]), "ffn_dim": st.sampled_from([8, 40, -8]),
}, optional={"n_kv_heads": st.sampled_from([1, 2, 0]), "tie_embeddings": st.booleans(), "qkv_bias": st.booleans(),
             "qk_norm": st.booleans(), "max_seq_len": st.sampled_from([16, 64, 128])})
CONFIG = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), CONFIG_VALUE, max_size=3).map(lambda d: {"base": "tiny", **d}),
    SMALL_MODEL,
    st.one_of(st.lists(st.integers(), max_size=2), st.integers(), st.text(max_size=5), st.none()),
)
COMMON = {
    "--model": st.one_of(st.sampled_from(["llama3-70b", "nope", "tiny.json"]), CONFIG),
    "--seq-len": st.one_of(INT, st.sampled_from(["100000000", "2048"])),
    "--micro-batch": st.one_of(INT, st.just("64")),
    "--grad-accum": INT,
    "--dtype": st.one_of(st.sampled_from(["bf16", "fp16", "float32", "torch.bfloat16"]), HOSTILE_TEXT),
    "--clip-norm": FLOAT,
    "--gpu-mem": BYTES,
    "--host-mem": BYTES,
    "--hardware": st.sampled_from(["h100-sxm", "tpu", "{d}/bad.json", "{d}/good.bin", "{d}", ""]),
}
TRAIN_ONLY = {
    "--steps": st.one_of(st.sampled_from(["2", "0", "-1", "x", "1.5"]), HOSTILE_TEXT),
    "--lr": FLOAT, "--weight-decay": FLOAT, "--warmup": INT, "--log-every": INT, "--eval-every": INT,
    "--seed": st.one_of(st.sampled_from(["7", str(2**63), str(2**70)]), INT),
    "--data": st.sampled_from(["dtype.bin", "odd.bin", "vocab.bin", "nosidecar.bin", "badside.bin", "short.bin",
                               "missing.bin", "bad.json"]),
    "--val-data": st.sampled_from(["good.bin", "vocab.bin", "missing.bin"]),
    "--checkpoint-every": INT, "--keep-checkpoints": INT,
    "--on-nan": st.sampled_from(["skip", "x", ""]),
    "--resume": st.sampled_from(["{d}/ckpt_empty", "{d}", "{d}/nowhere", "{d}/good.bin"]),
    "--metrics": st.sampled_from(["{d}/a_file/x", "{d}", "{d}/m.jsonl"]),
    "--trace": st.sampled_from(["{d}/a_file/x", "{d}"]),
    "--device": st.sampled_from(["tpu", "", "auto"]),
    # NOTE: small budgets only: a random "7G" lets a random 800M-parameter config plan, and then really train
    "--gpu-mem": st.one_of(st.sampled_from(["8MiB", "2MiB", "16MiB", "80XB", "0", "1e400GiB", "nanGiB", "1.5",
                                            "6 MiB", "6mib", "3TiB"]), HOSTILE_TEXT),
}


def overrides(table: dict) -> st.SearchStrategy:
    flag = st.sampled_from(sorted(table))
    return st.lists(flag.flatmap(lambda f: st.tuples(st.just(f), table[f])), max_size=3, unique_by=lambda t: t[0])


def _argv(files, base: dict, changes) -> list[str]:
    args = dict(base)
    for flag, value in changes:
        if flag == "--model" and not isinstance(value, str):
            value = _write_config(files, value, ".json" if len(args) % 2 else ".toml")
        elif flag in ("--data", "--val-data"):
            value = str(files / value) if value else ""
        args[flag] = value.replace("{d}", str(files)) if isinstance(value, str) else value
    return [x for flag, value in args.items() for x in (flag, value)]


def _write_config(files, config, suffix) -> str:
    path = files / f"random{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(config))
    else:  # TOML by hand, hostile values and all
        path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
                        if isinstance(config, dict) else str(config))
    return str(path)


def _check(argv) -> None:
    rc, out, err = run_cli(argv)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        assert_one_line(rc, err)


PLAN_BASE = {"--model": "tiny", "--seq-len": "64", "--micro-batch": "2", "--hardware": "cpu", "--gpu-mem": "6MiB",
             "--dtype": "fp32"}


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(["plan", "plan", "inspect"]), changes=overrides(COMMON))
def test_hypothesis_config_and_plan_arguments(files, command, changes):
    base = PLAN_BASE if command == "plan" else {k: PLAN_BASE[k] for k in ("--model", "--seq-len", "--micro-batch")}
    if command == "inspect":
        changes = [(f, v) for f, v in changes if f in ("--model", "--seq-len", "--micro-batch", "--dtype")]
    _check([command, *_argv(files, base, changes)])


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(changes=overrides({**COMMON, **TRAIN_ONLY}))
def test_hypothesis_train_arguments(files, tmp_path_factory, changes):
    # NOTE: --host-mem 1GiB makes the planner refuse any random config too big to really train here (a random
    # 1B-parameter config under a random "3TiB" budget would otherwise allocate most of the machine's RAM).
    base = {**PLAN_BASE, "--seq-len": "32", "--micro-batch": "1", "--steps": "1", "--lr": "1e-3",
            "--data": str(files / "good.bin"), "--device": "sim", "--checkpoint-dir": str(tmp_path_factory.mktemp("ck")),
            "--host-mem": "1GiB"}
    del base["--hardware"]
    changes = [(flag, value) for flag, value in changes if flag != "--host-mem"]
    if not any(flag == "--checkpoint-every" for flag, _ in changes):
        del base["--checkpoint-dir"]  # it needs --checkpoint-every (refused alone); there, it keeps ./checkpoints out
    _check(["train", "--no-progress", *_argv(files, base, changes)])


def test_config_whose_weights_overflow_int64_is_one_line(files):
    path = files / "overflow.json"
    path.write_text(json.dumps({"base": "tiny", "d_model": 2**40, "n_heads": 1, "n_kv_heads": 1}))
    rc, _, err = run_cli(["plan", "--model", str(path), "--hardware", "cpu", "--seq-len", "64"])
    assert_one_line(rc, err, "d_model")


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--micro-batch", "100000"], "--micro-batch"),
    (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--micro-batch", "60000"], "--grad-accum"),
    (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--grad-accum", "0"], "--grad-accum"),
    (["plan", "--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--save", "/dev/null/x.json"], "--save"),
    (["plan", "--model", "tiny", "--hardware", "/bin/sh", "--seq-len", "64"], "/bin/sh"),
])
def test_sizes_flags_and_paths_are_one_line(argv, needle):
    rc, _, err = run_cli(argv)
    assert_one_line(rc, err, needle)


def test_layer_count_is_bounded(files):
    path = files / "deep.json"
    path.write_text(json.dumps({"base": "tiny", "n_layers": 100000}))
    rc, _, err = run_cli(["plan", "--model", str(path), "--hardware", "cpu", "--seq-len", "64"])
    assert_one_line(rc, err, "n_layers")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`megatrain inspect ... | head -c 10`: the pipe closes under the output; the command ends as cat does
    (141, the SIGPIPE code), with no "error: [Errno 32] Broken pipe"."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "megatrain", "inspect", "--model", "llama3-70b", "--seq-len", "8192",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
