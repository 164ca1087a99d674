"""Checkpoints, exact resume, integrity, folder ownership and export, in process.

The kill tests (a real SIGKILL mid-step and mid-save) are in test_resume_kill.py; NaN handling and the host
memory check in test_checkpoint_faults.py. Trainers here share plans (checkpoint_helpers.py), so the module
runs in seconds on the tiny preset with the sim device.
"""

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from checkpoint_helpers import SPEC, TINY, assert_same_state, make, snapshot
from safetensors import safe_open
from safetensors.torch import load_file

from megatrain.cli import main
from megatrain.ir.trace import trace
from megatrain.models import ModelConfig
from megatrain.models.hf import hf_name
from megatrain.runtime.checkpoint import CheckpointError, _raw, find_checkpoint, save_checkpoint, step_dirs
from megatrain.runtime.export import export_weights
from megatrain.runtime.store import HostStore


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def saved(token_files, tmp_path_factory):
    """A checkpoint at step 2 of the tiny model, and the state it holds."""
    root = tmp_path_factory.mktemp("ck")
    with make(token_files, checkpoint_dir=root, checkpoint_every=2) as t:
        t.run(2, progress=False)
        return root / "step-00000002", snapshot(t.store)


def copy_ckpt(src, tmp_path):
    dst = tmp_path / "ck" / src.name
    shutil.copytree(src, dst)
    return dst


# -- layout and format ------------------------------------------------------------------------------------------
def test_checkpoint_layout_manifest_and_safetensors(saved):
    ckpt, state = saved
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["model"]["name"] == "tiny"
    assert manifest["train"] == SPEC.model_dump(mode="json")
    assert manifest["data"]["step"] == 2 and manifest["data"]["seed"] == 0
    assert len(manifest["plan_sha256"]) == 64
    units = ["embed", *(f"blocks.{i}" for i in range(4)), "head"]
    assert [u["name"] for u in manifest["units"]] == units
    assert set(manifest["files"]) == {f"{u}.safetensors" for u in units} | {"state.safetensors"}
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".") and p.name != ".megatrain.lock"]  # no temporary left
    for name, rec in manifest["files"].items():
        assert (ckpt / name).stat().st_size == rec["bytes"]
    # the files are plain safetensors: the library reads them, and they hold exactly the store's state
    for unit in units:
        with safe_open(ckpt / f"{unit}.safetensors", framework="pt") as f:
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), state[key]), key
    rng = load_file(ckpt / "state.safetensors")
    assert rng["rng/torch_cpu"].dtype == torch.uint8
    kinds = {k.split("/")[0] for k in state}
    assert kinds == {"master", "exp_avg", "exp_avg_sq", "step"}
    assert all(float(v) == 2 for k, v in state.items() if k.startswith("step/"))


# -- exact resume -------------------------------------------------------------------------------------------------
TIED = ModelConfig(**{**TINY.model_dump(), "name": "tiny-tied", "tie_embeddings": True, "n_layers": 2,
                      "qkv_bias": True})


@pytest.mark.parametrize("model, train, on_nan", [
    (TINY, SPEC, "abort"),
    (TIED, SPEC.replace(dtype="bf16", clip_norm=0.5, grad_accum=2), "abort"),
    (TINY, SPEC, "skip"),
], ids=["fp32", "bf16-clip-tied-accum", "skip-barrier"])
def test_resume_is_bit_identical(token_files, tmp_path, model, train, on_nan):
    with make(token_files, train, model, on_nan=on_nan) as t:
        straight = t.run(5, progress=False)
        want = snapshot(t.store)
    with make(token_files, train, model, on_nan=on_nan, checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(3, progress=False)  # checkpoints at 2 and 3 (the last step)
    with make(token_files, train, model, on_nan=on_nan, resume=tmp_path / "step-00000002") as t:
        assert t.step == 2 and t.engine.step_index == 2
        resumed = t.run(3, progress=False)
        assert_same_state(snapshot(t.store), want)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight[2:]]


def test_keep_last_k_and_replace(token_files, tmp_path):
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=2) as t:
        t.run(4, progress=False)
        assert [s for s, _ in step_dirs(tmp_path)] == [3, 4]
        assert find_checkpoint(tmp_path) == tmp_path / "step-00000004"
        t.save_checkpoint()  # the same step again: replaced whole
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != ".megatrain.lock"]


def test_interrupted_save_leaves_nothing_and_stale_temporaries_go(token_files, tmp_path):
    stale = tmp_path / ".step-00000009.tmp-999999999"  # a save killed in a process that is gone
    stale.mkdir(parents=True)
    with make(token_files) as t:
        t.run(1, progress=False)

        def boom(name):
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError):
            save_checkpoint(tmp_path, 1, t.store, {"model": {}, "train": {}}, after_file=boom)
        assert list(tmp_path.iterdir()) == []  # neither the stale nor the failed temporary, no step-00000001


def test_a_step_folder_without_a_manifest_is_no_checkpoint_and_never_costs_one(token_files, tmp_path):
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(4, progress=False)
    junk = tmp_path / "step-00000009"  # an interrupted copy, say: the newest name, no manifest
    junk.mkdir()
    (junk / "embed.safetensors").write_bytes(b"x")
    assert [s for s, _ in step_dirs(tmp_path)] == [2, 4]
    assert find_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=1,
              resume=tmp_path / "step-00000002") as t:
        t.run(1, progress=False)  # saves step 3; keeps the newest (4) and the one it wrote, prunes 2
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 4] and (junk / "embed.safetensors").read_bytes() == b"x"
    with pytest.raises(CheckpointError, match="use the previous checkpoint, .*step-00000004"):
        make(token_files, resume=junk)


def test_a_save_never_prunes_itself_when_a_rerun_finds_later_checkpoints(token_files, tmp_path):
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(4, progress=False)
    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=1,
              resume=tmp_path / "step-00000002") as t:
        t.run(1, progress=False)
    assert [s for s, _ in step_dirs(tmp_path)] == [3, 4]  # the folder just written survives its own prune


def test_a_failed_rename_puts_the_replaced_checkpoint_back(token_files, tmp_path, monkeypatch):
    import os

    from megatrain.runtime import checkpoint

    with make(token_files, checkpoint_dir=tmp_path, checkpoint_every=2) as t:
        t.run(2, progress=False)
        before = _digests(tmp_path / "step-00000002")
        real = os.replace

        def flaky(src, dst):
            if ".tmp-" in str(src):
                raise OSError(5, "Input/output error (injected)")
            return real(src, dst)

        monkeypatch.setattr(checkpoint.os, "replace", flaky)
        with pytest.raises(CheckpointError, match=r"injected\); the last checkpoint, .*step-00000002, is intact"):
            t.save_checkpoint()  # the same step again
        monkeypatch.undo()
    assert _digests(tmp_path / "step-00000002") == before
    # a kill between the two renames: the set-aside folder is renamed back by the next save's clean-up
    os.rename(tmp_path / "step-00000002", tmp_path / ".step-00000002.old-999999999")
    checkpoint.remove_stale(tmp_path)
    assert _digests(tmp_path / "step-00000002") == before


def test_a_linked_step_folder_is_pruned_as_a_link_and_its_target_kept(token_files, tmp_path):
    with make(token_files, checkpoint_dir=tmp_path / "a", checkpoint_every=2) as t:
        t.run(2, progress=False)
    elsewhere = tmp_path / "a" / "step-00000002"
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step-00000002").symlink_to(elsewhere, target_is_directory=True)  # a checkpoint linked in by hand
    before = _digests(elsewhere)
    with make(token_files, checkpoint_dir=ck, checkpoint_every=2, keep_checkpoints=1, resume=ck) as t:
        t.run(2, progress=False)  # saves step 4, prunes step 2: the link
    assert _digests(elsewhere) == before  # its target untouched
    assert sorted(p.name for p in ck.iterdir()) == [".megatrain.lock", "step-00000004"]  # no hidden link left


def _digests(folder) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# -- integrity ----------------------------------------------------------------------------------------------------
def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _edit_manifest(path):
    text = path.read_text()
    path.write_text(text.replace('"step": 2,', '"step": 3,', 1))


CORRUPTIONS = [
    ("blocks.1.safetensors", lambda p: _flip(p, p.stat().st_size - 1000), "sha256"),
    ("blocks.1.safetensors", lambda p: _flip(p, 30), "blocks.1.safetensors"),
    ("embed.safetensors", _truncate, "truncated"),
    ("head.safetensors", lambda p: p.unlink(), "missing"),
    ("state.safetensors", lambda p: p.unlink(), "missing"),
    ("manifest.json", _edit_manifest, "sha256"),
    ("manifest.json", _truncate, "not valid JSON"),
    ("manifest.json", lambda p: p.unlink(), "missing"),
]


@pytest.mark.parametrize("name, corrupt, problem", CORRUPTIONS,
                         ids=["flipped-data", "flipped-header", "truncated", "missing-unit", "missing-state",
                              "edited-manifest", "truncated-manifest", "missing-manifest"])
def test_corrupt_checkpoint_names_the_file_and_problem(token_files, saved, tmp_path, name, corrupt, problem):
    ckpt = copy_ckpt(saved[0], tmp_path)
    corrupt(ckpt / name)
    with pytest.raises(CheckpointError) as info:  # a unit file's data is checked as the first step reads it
        with make(token_files, resume=ckpt) as t:
            t.run(1, progress=False)
    message = str(info.value)
    assert name in message and problem in message and "\n" not in message


def test_checkpoint_of_another_model_or_settings_is_refused(token_files, saved):
    other = ModelConfig(**{**TINY.model_dump(), "name": "wide", "d_model": 256})
    with pytest.raises(CheckpointError, match=r"manifest.json: the checkpoint is of another model, 'tiny' "
                                               r"\(d_model 128 vs 256"):
        make(token_files, model=other, resume=saved[0])
    with pytest.raises(CheckpointError, match="lr 0.003 vs 0.001"):
        make(token_files, train=SPEC.replace(lr=1e-3), resume=saved[0])
    with pytest.raises(CheckpointError, match="different data order"):
        make(token_files, data=token_files[1], resume=saved[0])


def test_resume_never_unpickles(token_files, saved, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    with make(token_files, resume=saved[0]) as t:
        assert_same_state(snapshot(t.store), saved[1])


def test_a_save_by_hand_takes_the_folder_lock_and_keeps_out_of_another_runs_folder(token_files, tmp_path):
    """checkpoint_every=0 with save_checkpoint(): one writer a folder still (the lock, at the first save), and
    a folder another run wrote into meanwhile is refused, not mixed with or pruned."""
    folder = tmp_path / "ck"
    with make(token_files, checkpoint_dir=folder) as b:  # built while the folder is empty
        with make(token_files, checkpoint_dir=folder, checkpoint_every=1) as a:
            a.run(2, progress=False)
            b.run(1, progress=False)
            with pytest.raises(CheckpointError, match="another megatrain run"):
                b.save_checkpoint()
        with pytest.raises(CheckpointError, match="already holds checkpoints of another run"):
            b.save_checkpoint()  # a's lock is gone, its checkpoints are not
    assert [s for s, _ in step_dirs(folder)] == [1, 2]
    with make(token_files, checkpoint_dir=tmp_path / "own") as d:  # its own folder: saves, and again
        d.run(1, progress=False)
        d.save_checkpoint()
        d.run(1, progress=False)
        d.save_checkpoint()
    assert [s for s, _ in step_dirs(tmp_path / "own")] == [1, 2]


def test_no_checkpoint_to_resume(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        find_checkpoint(tmp_path / "nope")


def test_cli_resume_of_a_corrupt_checkpoint_is_one_line(token_files, saved, tmp_path, capsys):
    ckpt = copy_ckpt(saved[0], tmp_path)
    _flip(ckpt / "blocks.2.safetensors", (ckpt / "blocks.2.safetensors").stat().st_size // 2)
    rc = main(["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
               "--micro-batch", "2", "--dtype", "fp32", "--steps", "6", "--lr", "3e-3", "--warmup", "1",
               "--data", str(token_files[0]), "--no-progress", "--resume", str(ckpt.parent)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "blocks.2.safetensors" in err and "sha256" in err
    assert "--resume" in err and "previous checkpoint" not in err  # no earlier one to suggest here


# -- export -------------------------------------------------------------------------------------------------------
def llama_state_dict_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of Hugging Face LlamaForCausalLM.state_dict() (Qwen2 with qkv_bias), by hand."""
    hd, kv = c.d_model // c.n_heads, c.n_kv_heads or c.n_heads
    sd = {"model.embed_tokens.weight": (c.vocab_size, c.d_model)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = (c.d_model,)
        sd[p + "self_attn.q_proj.weight"] = (c.n_heads * hd, c.d_model)
        sd[p + "self_attn.k_proj.weight"] = (kv * hd, c.d_model)
        sd[p + "self_attn.v_proj.weight"] = (kv * hd, c.d_model)
        if c.qkv_bias:
            sd[p + "self_attn.q_proj.bias"] = (c.n_heads * hd,)
            sd[p + "self_attn.k_proj.bias"] = (kv * hd,)
            sd[p + "self_attn.v_proj.bias"] = (kv * hd,)
        sd[p + "self_attn.o_proj.weight"] = (c.d_model, c.n_heads * hd)
        sd[p + "post_attention_layernorm.weight"] = (c.d_model,)
        sd[p + "mlp.gate_proj.weight"] = (c.ffn_dim, c.d_model)
        sd[p + "mlp.up_proj.weight"] = (c.ffn_dim, c.d_model)
        sd[p + "mlp.down_proj.weight"] = (c.d_model, c.ffn_dim)
    sd["model.norm.weight"] = (c.d_model,)
    if not c.tie_embeddings:
        sd["lm_head.weight"] = (c.vocab_size, c.d_model)
    return sd


def test_export_matches_a_llama_state_dict(saved, tmp_path, capsys):
    ckpt, state = saved
    out = tmp_path / "out" / "model.safetensors"
    assert main(["export", "--checkpoint", str(ckpt.parent), "--out", str(out)]) == 0
    assert "wrote 39 tensors" in capsys.readouterr().out
    weights = load_file(out)
    assert {k: tuple(v.shape) for k, v in weights.items()} == llama_state_dict_shapes(TINY)
    masters = {k.removeprefix("master/"): v for k, v in state.items() if k.startswith("master/")}
    for name, t in masters.items():
        assert torch.equal(weights[hf_name(name)], t), name
    with safe_open(out, framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "bf16"]) == 0
    half = load_file(out)
    assert all(half[hf_name(n)].dtype == torch.bfloat16 and torch.equal(half[hf_name(n)], t.bfloat16())
               for n, t in masters.items())
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--names", "megatrain"]) == 0
    assert set(load_file(out)) == set(masters)


@pytest.mark.parametrize("variant", [{"tie_embeddings": True, "qkv_bias": True}, {"qk_norm": True}])
def test_export_tied_qkv_bias_and_qk_norm(tmp_path, variant):
    """Qwen2's q/k/v biases (here with a tied head) and Qwen3's qk-norm export under Hugging Face names."""
    config = ModelConfig(**{**TINY.model_dump(), **variant, "n_layers": 2})
    store = HostStore(trace(config, 1, 16, "fp32", target="cpu"), SPEC, seed=3)
    save_checkpoint(tmp_path / "ck", 0, store, {"model": config.model_dump(), "train": SPEC.model_dump(mode="json")})
    export_weights(tmp_path / "ck", tmp_path / "m.safetensors")
    weights = load_file(tmp_path / "m.safetensors")
    want = llama_state_dict_shapes(config)
    if config.qk_norm:
        want.update({f"model.layers.{i}.self_attn.{q}_norm.weight": (config.head_dim,) for i in range(2) for q in "qk"})
    assert {k: tuple(v.shape) for k, v in weights.items()} == want
    assert ("lm_head.weight" in weights) == (not config.tie_embeddings)
    for name, t in store.named_master().items():
        assert torch.equal(weights[hf_name(name)], t)


@pytest.mark.parametrize("variant", [{"qk_norm": True, "qkv_bias": True}, {"depth_mixing": "denseformer"},
                                     {"depth_mixing": "hc:2"}])
def test_export_refuses_models_without_a_hugging_face_equivalent(tmp_path, variant, capsys):
    """A DenseFormer once exported with Llama names and loaded in transformers as a plain residual model:
    now every model no Hugging Face family computes is refused, naming --names megatrain."""
    config = ModelConfig(**{**TINY.model_dump(), **variant, "n_layers": 2})
    store = HostStore(trace(config, 1, 16, "fp32", target="cpu"), SPEC, seed=3)
    save_checkpoint(tmp_path / "ck", 0, store, {"model": config.model_dump(), "train": SPEC.model_dump(mode="json")})
    for out in ("m.safetensors", "hf_dir"):
        assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert "no Hugging Face equivalent" in err and "--names megatrain" in err and err.count("\n") == 1
        assert not (tmp_path / out).exists()
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "m.safetensors"),
                 "--names", "megatrain"]) == 0
    assert set(load_file(tmp_path / "m.safetensors")) == set(store.named_master())


def test_export_of_a_corrupt_checkpoint_writes_nothing(saved, tmp_path, capsys):
    ckpt = copy_ckpt(saved[0], tmp_path)
    _flip(ckpt / "head.safetensors", (ckpt / "head.safetensors").stat().st_size - 8)
    out = tmp_path / "m.safetensors"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "head.safetensors" in err and "sha256" in err and err.count("\n") == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_export_racing_a_prune_says_so_and_names_the_newest(saved, tmp_path, monkeypatch, capsys):
    from megatrain.runtime import export

    ckpt = copy_ckpt(saved[0], tmp_path)
    shutil.copytree(ckpt, ckpt.parent / "step-00000003")  # (a copy stands in for the run's newer checkpoint)
    real = export._write_shards

    def pruned_meanwhile(*args, **kw):  # the run writing beside the export prunes its checkpoint mid-read
        shutil.rmtree(ckpt)
        return real(*args, **kw)

    monkeypatch.setattr(export, "_write_shards", pruned_meanwhile)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "removed while it was exported" in err and "step-00000003" in err and err.count("\n") == 1, err


def test_hf_name_refuses_unknown_parameters():
    assert hf_name("blocks.11.self_attn.q_norm.weight") == "model.layers.11.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match="--names megatrain"):
        hf_name("mixer.depth_ssd.A")


def test_saving_copies_nothing():
    """What a save writes are views of the store's memory, handed to the file as bytes without a copy."""
    store = HostStore(trace(TINY, 1, 16, "fp32", target="cpu"), SPEC)
    views = store.state_tensors("blocks.0")
    views["master/blocks.0.mlp.up_proj.weight"].fill_(7.0)
    assert (store.named_master()["blocks.0.mlp.up_proj.weight"] == 7.0).all()
    for t in views.values():
        raw = _raw(t)
        assert raw.nbytes == t.numel() * 4 and np.shares_memory(np.asarray(raw), t.numpy())
