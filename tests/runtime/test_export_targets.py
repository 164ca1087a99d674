"""`megatrain export` never destroys a folder it did not write, and carries the named chat templates.

An exported folder is marked (its weights' metadata names megatrain and the folder); an existing folder
without that mark (a downloaded model, a copy of an export, anything non-empty) is refused in one line unless
--overwrite, a Hugging Face cache snapshot even then, and `--out .` says why in one line.
"""

import json
import os
import shutil

import pytest
from hf_models import save_hf_model

from megatrain.cli import main
from megatrain.ir.trace import trace
from megatrain.models import load_model_config
from megatrain.planner import TrainSpec
from megatrain.runtime.checkpoint import save_checkpoint
from megatrain.runtime.hf_load import source_files
from megatrain.runtime.store import HostStore
from megatrain.runtime.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL_USE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture()
def ckpt(tmp_path, hf_folder):
    """A checkpoint of a model folder whose tokenizer has a default and a named chat template."""
    src, hf_tok = hf_folder("src", chat_template=CHATML, eos_token="<|im_end|>")
    save_hf_model(src, "llama", vocab_size=len(hf_tok), hidden_size=64, num_hidden_layers=2)
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    config = load_model_config(src)
    store = HostStore(trace(config, 1, 16, "fp32", target="cpu"), TrainSpec(micro_batch=1, seq_len=16, dtype="fp32"))
    meta = {"model": config.model_dump(), "train": TrainSpec(micro_batch=1, seq_len=16).model_dump(mode="json")}
    return save_checkpoint(tmp_path / "ck", 1, store, meta, extra=source_files(src))


def _export(ckpt, out, *flags):
    return main(["export", "--checkpoint", str(ckpt), "--out", str(out), *flags])


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_named_chat_templates_are_exported(tmp_path, ckpt, transformers_lib):
    out = tmp_path / "out"
    assert _export(ckpt, out) == 0
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_USE
    assert Tokenizer.from_dir(out).chat_templates["tool_use"] == TOOL_USE
    hf = transformers_lib.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, chat_template="tool_use") == "user: hi\n"


def test_an_export_replaces_its_own_folder_and_nothing_else_unasked(tmp_path, ckpt, capsys):
    out = tmp_path / "out"
    assert _export(ckpt, out) == 0
    assert _export(ckpt, out, "--dtype", "bf16") == 0  # its own export: replaced
    capsys.readouterr()
    # a copy of the export elsewhere, and a downloaded model: refused, unchanged, unless --overwrite
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    other = tmp_path / "other-model"
    save_hf_model(other, "llama", seed=7, hidden_size=64, num_hidden_layers=2)
    for target in (copy, other):
        before = _files(target)
        assert _export(ckpt, target) == 2
        err = capsys.readouterr().err
        assert f"--out {target} holds a model that megatrain did not export there" in err and "--overwrite" in err
        assert err.count("\n") == 1 and _files(target) == before
        assert _export(ckpt, target, "--overwrite") == 0
        capsys.readouterr()
        assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 2
        assert _export(ckpt, target) == 0  # now megatrain's own export there
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    assert _export(ckpt, notes) == 2
    assert "notes.txt" in capsys.readouterr().err and (notes / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("layout", ["snapshot", "links"])
def test_a_hugging_face_cache_snapshot_is_refused_even_with_overwrite(tmp_path, ckpt, capsys, layout):
    model = tmp_path / "model"
    save_hf_model(model, "llama", seed=7, hidden_size=64, num_hidden_layers=2)
    root = tmp_path / "hub" / "models--org--tiny"
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    snap = root / "snapshots" / "0123abcd" if layout == "snapshot" else tmp_path / "linked"
    snap.mkdir(parents=True)
    for p in model.iterdir():  # as the hub lays it out: each file a link to its blob
        shutil.copy(p, blobs / p.name)
        os.symlink(os.path.relpath(blobs / p.name, snap), snap / p.name)
    before = _files(blobs)
    for flags in ((), ("--overwrite",)):
        assert _export(ckpt, snap, *flags) == 2
        err = capsys.readouterr().err
        assert "is a Hugging Face cache snapshot" in err and err.count("\n") == 1
    assert _files(blobs) == before and all((snap / p.name).is_symlink() for p in model.iterdir())


def test_out_dot_is_refused_in_one_clear_line(tmp_path, ckpt, capsys, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    (here / "work.txt").write_text("mine")
    monkeypatch.chdir(here)
    for flags in ((), ("--overwrite",)):
        assert _export(ckpt, ".", *flags) == 2
        err = capsys.readouterr().err
        assert "is the current folder" in err and "has an empty name" not in err and err.count("\n") == 1
    assert sorted(p.name for p in here.iterdir()) == ["work.txt"]
