"""Hugging Face model folders in and out, with transformers as the oracle.

For every family megatrain imports (Llama with GQA and MHA, Llama 3.1's llama3 RoPE scaling, Qwen2 with
q/k/v biases and tied embeddings, Qwen3 with qk-norm and its own head_dim, Mistral under its window):
megatrain's logits and loss from the folder equal transformers' at fp32; a folder trained 3 streamed steps
on the sim device and exported loads in transformers with no warning and gives megatrain's logits; what
cannot be trained exactly is refused in one line naming the field, the shard or the tensor.
"""

import json
import logging
import shutil
import warnings

import pytest
import torch
from hf_models import FAMILIES, save_hf_model

from megatrain.cli import main
from megatrain.ir.trace import trace
from megatrain.models import build_eager, load_model_config, preset
from megatrain.models.hf import HFConfigError, config_from_hf
from megatrain.planner import TrainSpec
from megatrain.runtime.hf_load import check_weights, load_weights
from megatrain.runtime.store import HostStore

pytest.importorskip("transformers")


def megatrain_model(folder, seq_len=32):
    """build_eager of the folder's config with the folder's weights, loaded as the Trainer loads them."""
    config = load_model_config(folder)
    store = HostStore(trace(config, 1, seq_len, "fp32", target="cpu"), TrainSpec(micro_batch=1, seq_len=seq_len,
                                                                                   dtype="fp32"), init=False)
    load_weights(check_weights(folder, config), store)
    model = build_eager(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(store.named_master()[name])
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_loss_equal_transformers(tmp_path, family):
    hf = save_hf_model(tmp_path, family, seed=1)
    ours = megatrain_model(tmp_path)
    x = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=x, labels=x)
        got = ours.logits(x)
        loss = ours(x[:, :-1], x[:, 1:]) / x[:, 1:].numel()
    torch.testing.assert_close(got, want.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=1e-6, atol=1e-6)


def test_bf16_weights_load_into_fp32_masters_exactly(tmp_path):
    hf = save_hf_model(tmp_path, "llama", seed=2, dtype=torch.bfloat16)
    config = load_model_config(tmp_path)
    store = HostStore(trace(config, 1, 16, "fp32", target="cpu"), TrainSpec(micro_batch=1, seq_len=16, dtype="fp32"),
                      init=False)
    assert load_weights(check_weights(tmp_path, config), store) == len(list(hf.parameters()))
    for name, p in hf.named_parameters():
        ours = name.replace("model.layers.", "blocks.").replace("model.embed_tokens", "embed.embed_tokens")
        ours = ours.replace("model.norm", "head.norm").replace("lm_head", "head.lm_head")
        assert torch.equal(store.named_master()[ours], p.detach().bfloat16().float()), name


def _quiet_load(folder):
    """from_pretrained with every warning and transformers log record captured."""
    import transformers

    transformers.logging.set_verbosity_warning()  # another fixture may have silenced it for the session
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    finally:
        logger.removeHandler(handler)
    problems = [str(w.message) for w in caught] + [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return model, problems


@pytest.mark.parametrize("family", ["llama3.1", "qwen2", "qwen3", "mistral"])
def test_import_train_export_round_trip(tmp_path, family):
    """HF folder -> 3 streamed steps on the sim device under a budget below the model's size -> export ->
    from_pretrained with no warning -> the same logits as megatrain's trained weights."""
    from runtime_schedules import make_token_files

    src = tmp_path / "src"
    hf_src = save_hf_model(src, family, seed=3, hidden_size=128, intermediate_size=256, num_hidden_layers=8)
    budget = 4 * 2**20
    assert sum(p.numel() for p in hf_src.parameters()) * 4 > budget  # the weights must stream
    train, _ = make_token_files(tmp_path)
    ck, out = tmp_path / "ck", tmp_path / "out"
    rc = main(["train", "--model", str(src), "--device", "sim", "--gpu-mem", str(budget), "--seq-len", "32",
               "--micro-batch", "2", "--dtype", "fp32", "--steps", "3", "--lr", "3e-3", "--data", str(train),
               "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--no-progress"])
    assert rc == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 0
    hf, problems = _quiet_load(out)
    assert problems == []
    assert type(hf).__name__ == json.loads((src / "config.json").read_text())["architectures"][0]
    trained = megatrain_model(out)  # the exported folder read back by megatrain...
    from megatrain.runtime.checkpoint import find_checkpoint, read_manifest

    manifest = read_manifest(find_checkpoint(ck))
    assert manifest["step"] == 3 and "hf/config.json" in manifest["files"]
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(trained.logits(x), hf(input_ids=x).logits, rtol=0, atol=1e-5)
    before = megatrain_model(src)  # ...and it trained: the weights moved
    assert not torch.equal(before.embed.embed_tokens.weight, trained.embed.embed_tokens.weight)


def test_sharded_export_round_trips_and_replaces_an_earlier_export(tmp_path):
    from runtime_schedules import make_token_files

    src = tmp_path / "src"
    save_hf_model(src, "llama", seed=4)
    train, _ = make_token_files(tmp_path)
    ck = tmp_path / "ck"
    assert main(["train", "--model", str(src), "--device", "sim", "--gpu-mem", "8MiB", "--seq-len", "16",
                 "--dtype", "fp32", "--steps", "1", "--data", str(train), "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "1", "--no-progress"]) == 0
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(ck), "--out", str(out), "--max-shard-size", "100KB"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    hf, problems = _quiet_load(out)
    assert problems == []
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(megatrain_model(out, 16).logits(x), hf(input_ids=x).logits, rtol=0, atol=1e-5)
    # an export over an earlier one replaces it whole: no stale shard is left behind
    assert main(["export", "--checkpoint", str(ck), "--out", str(out), "--dtype", "bf16"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # ...but never over the base model the run started from (it holds just what an export writes)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for target in (src, src / "model.safetensors"):
        assert main(["export", "--checkpoint", str(ck), "--out", str(target)]) == 2
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_export_refuses_a_folder_it_did_not_write_and_a_path_inside_the_checkpoint(tmp_path, capsys):
    src = tmp_path / "src"
    save_hf_model(src, "llama", seed=4)
    store = HostStore(trace(load_model_config(src), 1, 16, "fp32", target="cpu"),
                      TrainSpec(micro_batch=1, seq_len=16, dtype="fp32"))
    from megatrain.runtime.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ck", 1, store, {"model": load_model_config(src).model_dump(),
                                                       "train": TrainSpec(micro_batch=1, seq_len=16).model_dump(mode="json")})
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for out, what in ((mine, "notes.txt"), (ckpt / "x", "inside"), (tmp_path / "ck", "inside")):
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert what in err and err.count("\n") == 1, err
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["embed.safetensors", "blocks.0.safetensors",
                                                            "blocks.1.safetensors", "head.safetensors",
                                                            "state.safetensors", "manifest.json"])


# -- configs ------------------------------------------------------------------------------------------------
QWEN25_14B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 13824, "max_position_embeddings": 131072, "max_window_layers": 48, "model_type": "qwen2",
    "num_attention_heads": 40, "num_hidden_layers": 48, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 128256}


@pytest.mark.parametrize("raw, preset_name", [(QWEN25_14B, "qwen2.5-14b"), (LLAMA31_8B, "llama3-8b")])
def test_plan_a_real_shaped_config_json_counts_the_presets_parameters(tmp_path, raw, preset_name, capsys):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--hardware", "h100-sxm", "--seq-len", "4096", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["params"] == preset(preset_name).n_params() and summary["feasible"]
    assert main(["inspect", "--model", str(tmp_path), "--seq-len", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params_total"] == summary["params"]


SMALL = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 32, "max_position_embeddings": 8192}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# config.json documents that leave a field to its family's default, or set it to null: transformers' defaults
# are not one rule (Qwen3's head_dim is 128, not hidden / heads; Mistral and Qwen slide 4096 tokens; an absent
# num_key_value_heads is 32 or 8 where a null one is the number of heads)
DEFAULTED = [
    ("LlamaForCausalLM", {}), ("LlamaForCausalLM", {"num_key_value_heads": None, "head_dim": None}),
    ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),  # original_max_position_embeddings absent
    ("LlamaForCausalLM", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}),
    ("Qwen2ForCausalLM", {}), ("Qwen2ForCausalLM", {"num_key_value_heads": None, "num_attention_heads": 16}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 1}),  # sliding_window absent: 4096
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1}),
    ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 64, "max_window_layers": 1}),
    ("Qwen3ForCausalLM", {}), ("Qwen3ForCausalLM", {"head_dim": 8}),
    ("Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 0}),
    ("MistralForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": None}),
]


@pytest.mark.parametrize("arch, fields", DEFAULTED)
def test_absent_and_null_fields_take_transformers_defaults(arch, fields):
    import transformers

    raw = {"architectures": [arch], **SMALL, **fields}
    theirs = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**raw)
    ours = config_from_hf(raw)
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or raw["hidden_size"] // raw["num_attention_heads"])
    assert ours.kv_heads == theirs.num_key_value_heads
    slides = "sliding_attention" in (getattr(theirs, "layer_types", None) or ()) or (
        arch == "MistralForCausalLM" and theirs.sliding_window is not None)
    assert ours.sliding_window == (theirs.sliding_window if slides else None)
    rope = theirs.rope_parameters
    assert (ours.rope_scaling is None) == (rope["rope_type"] == "default")
    if ours.rope_scaling is not None:
        assert ours.rope_scaling.original_max_position == rope["original_max_position_embeddings"] == 8192


def test_sliding_layers_without_use_sliding_window_are_refused():
    raw = {"architectures": ["Qwen2ForCausalLM"], **SMALL, "use_sliding_window": False, "sliding_window": 16,
           "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(HFConfigError, match="layer_types: names sliding_attention layers while use_sliding_window"):
        config_from_hf(raw)


def test_llama31_rope_scaling_and_long_context_fields_map():
    config = config_from_hf(LLAMA31_8B)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert config.rope_scaling.original_max_position == 8192 and config.max_seq_len == 131072
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert config_from_hf(v5) == config


BAD = [
    ({"architectures": ["GemmaForCausalLM"]}, "architectures 'GemmaForCausalLM' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn' is not implemented"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type: 'linear'"),
    ({"attention_bias": True}, "attention_bias: true adds a bias to o_proj"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not implemented"),
    ({"attention_dropout": 0.1}, "attention_dropout: 0.1 > 0"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"auto_map": {"AutoModel": "x.Y"}}, "auto_map"),
    ({"logit_scale": 0.5}, "logit_scale: unknown field"),
    ({"hidden_size": "4096"}, "hidden_size: required integer field is '4096'"),
    ({"num_attention_heads": 7}, "n_heads=7 must divide d_model=4096"),
    # a string is no boolean: "false" in quotes would read as true (issue 41)
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings: expected true or false, got 'false'"),
    ({"attention_bias": "false"}, "attention_bias: expected true or false, got 'false'"),
    ({"use_mrope": 0}, "use_mrope: expected true or false, got 0"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_unsupported_config_fields_are_refused_in_one_line(tmp_path, change, message, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_8B, **change}))
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert message in err and "config.json" in err and err.count("\n") == 1, err
    with pytest.raises(HFConfigError):
        config_from_hf({**LLAMA31_8B, **change})


def test_a_sliding_window_in_effect_is_refused_at_that_sequence_length(tmp_path, capsys):
    raw = {**QWEN25_14B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "8192"]) == 2
    assert "sliding attention window of 4096 tokens" in capsys.readouterr().err
    assert config_from_hf({**raw, "max_window_layers": 48}).sliding_window is None  # no layer slides


def test_a_folder_without_config_json_is_refused(tmp_path, capsys):
    assert main(["inspect", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "without config.json" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", "--model", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def _train_cli(folder, data):
    return ["train", "--model", str(folder), "--device", "sim", "--gpu-mem", "8MiB", "--seq-len", "16",
            "--dtype", "fp32", "--steps", "1", "--data", str(data), "--no-progress"]


@pytest.fixture()
def data(tmp_path):
    from runtime_schedules import make_token_files

    (tmp_path / "d").mkdir()
    return make_token_files(tmp_path / "d")[0]


def test_missing_and_corrupt_shards_and_wrong_tensors_are_named(tmp_path, data, capsys):
    src = tmp_path / "src"
    save_hf_model(src, "qwen3", seed=6)
    out = tmp_path / "sharded"
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    hf = save_hf_model(tmp_path / "tmp", "qwen3", seed=6)
    hf.save_pretrained(out, max_shard_size="100KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    cases = []
    gone = tmp_path / "gone"
    shutil.copytree(out, gone)
    (gone / shards[1].name).unlink()
    cases.append((gone, f"{shards[1].name}: shard listed in model.safetensors.index.json is missing"))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(out, corrupt)
    with open(corrupt / shards[0].name, "r+b") as f:
        f.write(b"\xff" * 8)
    cases.append((corrupt, f"{shards[0].name}: corrupt header"))
    short = tmp_path / "short"
    shutil.copytree(out, short)
    with open(short / shards[-1].name, "r+b") as f:
        f.truncate((short / shards[-1].name).stat().st_size - 4)
    cases.append((short, shards[-1].name))
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    cases.append((wrong, "has shape [64, 96] but config.json makes it [64, 128]"))
    fewer = tmp_path / "fewer"
    shutil.copytree(src, fewer)
    (fewer / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    cases.append((fewer, "tensor model.layers.1.input_layernorm.weight is not part of the model"))
    more = tmp_path / "more"
    shutil.copytree(src, more)
    (more / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    cases.append((more, "the weights lack blocks.2."))
    nan = tmp_path / "nan"
    shutil.copytree(src, nan)
    from safetensors.torch import load_file, save_file

    weights = load_file(nan / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    cases.append((nan, "tensor model.layers.1.mlp.up_proj.weight holds NaN or inf values"))
    pickled = tmp_path / "pickled"
    shutil.copytree(src, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    cases.append((pickled, "PyTorch .bin weights, which megatrain does not load"))
    for folder, message in cases:
        assert main(_train_cli(folder, data)) == 2, folder
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (folder, err)


def test_a_tied_config_with_its_own_lm_head_is_refused_unless_it_equals_the_embedding(tmp_path, data, capsys):
    """tie_word_embeddings with an lm_head.weight in the file: loaders disagree on which the head is (transformers
    5 keeps the file's), so a head that differs from the embedding is refused; an equal one is the same model."""
    from safetensors.torch import load_file, save_file

    save_hf_model(tmp_path / "src", "qwen2", seed=3)
    weights = load_file(tmp_path / "src" / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    for name, head, ok in (("differs", torch.randn_like(embed), False), ("equal", embed.clone(), True)):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "src", folder)
        save_file({**weights, "lm_head.weight": head}, folder / "model.safetensors", metadata={"format": "pt"})
        rc = main(_train_cli(folder, data))
        out, err = capsys.readouterr()
        if ok:
            assert rc == 0, err
        else:
            assert rc == 2 and err.count("\n") == 1, err
            assert "lm_head.weight, which differs from model.embed_tokens.weight" in err and "tie_word_embeddings" in err


def test_depth_mixing_cannot_be_grafted_onto_a_model_folder(tmp_path, data, capsys):
    save_hf_model(tmp_path / "src", "llama")
    assert main([*_train_cli(tmp_path / "src", data), "--depth-mixing", "depthssd:2"]) == 2
    assert "--depth-mixing depthssd:2 would train another model" in capsys.readouterr().err
