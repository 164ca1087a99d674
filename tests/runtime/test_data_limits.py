"""Data that never loses answers silently, and input that cannot hang or abort the process.

Examples whose answer lies past --seq-len are counted and left out (prepare with --seq-len names them;
training leaves them out of its order and says so, so no step is all padding); a single file's split never
cuts a character; plain-text documents get the tokenizer's own bos; the chat template's hash is recorded and
checked; a hostile chat template is stopped by time and size limits, an oversized record is refused by its
line number, an empty JSONL is refused: each a one-line error with nothing written.
"""

import json
import threading

import pytest
from hf_models import save_hf_model

from megatrain.cli import main
from megatrain.runtime import chat, chat_limits
from megatrain.runtime.corpus import prepare
from megatrain.runtime.data import DataError, TokenFile, sidecar_path
from megatrain.runtime.tokenizer import Tokenizer, check_made_with

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SHORT = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                       {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(7)]
LONG = {"messages": [{"role": "user", "content": "Please read all of this first. " * 30},
                     {"role": "assistant", "content": "Done."}]}
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture()
def model_dir(hf_folder):
    folder, hf_tok = hf_folder("tiny-llama", chat_template=CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    save_hf_model(folder, "llama", vocab_size=len(hf_tok), hidden_size=64, num_hidden_layers=2)
    return folder, hf_tok


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in needles), err
    return err


# -- answers past --seq-len ---------------------------------------------------------------------------------
def test_a_prompt_longer_than_seq_len_trains_to_the_end_and_is_reported(tmp_path, model_dir, capsys):
    """The issue's case: short answers plus one prompt longer than --seq-len, --no-pack --micro-batch 1.
    Before, the step holding it had no target and the run stopped (and stopped again on resume)."""
    folder, _ = model_dir
    data = tmp_path / "sft"
    jsonl = _jsonl(tmp_path / "chat.jsonl", [LONG, *SHORT])
    assert main(["prepare", str(jsonl), "--tokenizer", str(folder), "--out", str(data), "--val-fraction", "0",
                 "--no-progress"]) == 0
    assert "longest example" in capsys.readouterr().out
    steps = len(SHORT) + 1  # an epoch and one more step: the long example's turn comes in every order
    rc = main(["train", "--model", str(folder), "--data", str(data / "train.bin"), "--device", "sim",
               "--gpu-mem", "8MiB", "--dtype", "fp32", "--seq-len", "32", "--micro-batch", "1", "--no-pack",
               "--steps", str(steps), "--metrics", str(tmp_path / "m.jsonl"), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()][-1] == steps
    assert "1 of 8 examples are longer than --seq-len 32" in captured.err
    assert "1 keep no answer token within it and are left out" in captured.err


def test_prepare_with_seq_len_counts_and_drops_by_file_and_line(tmp_path, model_dir, capsys):
    folder, _ = model_dir
    jsonl = _jsonl(tmp_path / "chat.jsonl", [*SHORT[:3], LONG, *SHORT[3:]])
    assert main(["prepare", str(jsonl), "--tokenizer", str(folder), "--out", str(tmp_path / "d"), "--seq-len", "32",
                 "--val-fraction", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "--seq-len 32: 1 example(s) longer" in out and "dropped 1 of them whose answer lies wholly past it (chat.jsonl:4)" in out
    tf = TokenFile.open(tmp_path / "d" / "train.bin")
    assert tf.meta["n_documents"] == len(SHORT) and tf.meta["cut"]["dropped_lines"] == ["chat.jsonl:4"]
    with pytest.raises(DataError, match="every example's answer lies past --seq-len 4"):
        prepare([jsonl], tmp_path / "d2", tokenizer=folder, seq_len=4)
    assert not list((tmp_path / "d2").glob("*.bin"))


# -- the split of a single file -----------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["é" * 1001, "naïve café " * 300], ids=["one-word", "words"])
def test_a_single_file_split_never_cuts_a_character(tmp_path, text):
    (tmp_path / "one.txt").write_text(text)
    train, val = prepare([tmp_path / "one.txt"], tmp_path / "out", val_fraction=0.05)
    parts = [TokenFile.open(p).tokens.tobytes()[::2].rstrip(b"\0") for p in (train, val)]  # uint16 byte tokens
    decoded = [p.decode("utf-8") for p in parts]  # raises on a cut character
    assert "".join(decoded) == text and all(decoded)


# -- bos of plain-text documents ----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["post-processor", "add_bos_token"])
def test_documents_get_the_tokenizers_own_bos(tmp_path, bpe, transformers_lib, how):
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(bpe.to_str())
    kw = {}
    if how == "post-processor":  # Llama 3's: bos before every document
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))])
    else:
        kw["add_bos_token"] = True
    fast = transformers_lib.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                                    eos_token="<|end_of_text|>", **kw)
    fast.save_pretrained(tmp_path / "tok")
    hf = transformers_lib.AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "def f(x):\n    return x\n"
    (tmp_path / "a.py").write_text(text)
    train, _ = prepare([tmp_path / "a.py"], tmp_path / "out", val_fraction=0, tokenizer=tmp_path / "tok")
    want = hf(text)["input_ids"]
    assert want[0] == hf.bos_token_id
    assert TokenFile.open(train).tokens.tolist() == want + [hf.eos_token_id]


# -- the chat template's hash -------------------------------------------------------------------------------
def test_data_rendered_under_another_chat_template_is_refused(tmp_path, model_dir):
    folder, _ = model_dir
    jsonl = _jsonl(tmp_path / "chat.jsonl", SHORT)
    train, _ = prepare([jsonl], tmp_path / "d", val_fraction=0, tokenizer=folder)
    meta = TokenFile.open(train).meta
    assert meta["chat_template_sha256"] == Tokenizer.from_dir(folder).chat_template_sha256
    check_made_with(train, meta, folder)  # the same folder: accepted
    (folder / "chat_template.jinja").write_text(CHATML.replace("\\n", " "))
    with pytest.raises(DataError, match="another chat template than the model's") as e:
        check_made_with(train, meta, folder)
    assert "\n" not in str(e.value) and f"--tokenizer {folder}" in str(e.value)


# -- bounded input ------------------------------------------------------------------------------------------
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops calling nothing": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "8 MiB per turn": "{% for m in messages %}{{ m.content }}{{ 'x' * 8388608 }}{% endfor %}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "recursion": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "a wide center": "{{ 'x' | center(10**12) }}",
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_chat_templates_stop_in_one_line_and_write_nothing(case, tmp_path, hf_folder, monkeypatch, capsys):
    monkeypatch.setattr(chat_limits, "RENDER_SECONDS", 0.5)
    folder, _ = hf_folder("hostile", chat_template=HOSTILE[case], eos_token="<|im_end|>")
    jsonl = _jsonl(tmp_path / "chat.jsonl", SHORT)
    assert main(["prepare", str(jsonl), "--tokenizer", str(folder), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    _one_line_error(capsys, "chat template", "rendering stopped")
    assert not list((tmp_path / "o").glob("*.bin*"))


def test_the_time_limit_holds_outside_the_main_thread(monkeypatch):
    monkeypatch.setattr(chat_limits, "RENDER_SECONDS", 0.3)
    errors = []

    def work():
        try:
            chat.render(HOSTILE["loops calling nothing"], MSGS, {})
        except DataError as e:
            errors.append(str(e))

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert not t.is_alive() and "longer than 0.3 s" in errors[0]


def test_an_oversized_record_is_refused_by_its_line_number(tmp_path, model_dir, capsys):
    folder, _ = model_dir
    big = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * (16 << 20)}]}
    jsonl = _jsonl(tmp_path / "chat.jsonl", [*SHORT[:2], big])
    assert main(["prepare", str(jsonl), "--tokenizer", str(folder), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    _one_line_error(capsys, "chat.jsonl:3", f"{chat_limits.MAX_EXAMPLE_BYTES >> 20} MiB")
    assert not list((tmp_path / "o").glob("*.bin*"))


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_jsonl_is_refused(tmp_path, model_dir, capsys, content):
    folder, _ = model_dir
    (tmp_path / "chat.jsonl").write_text(content)
    assert main(["prepare", str(tmp_path / "chat.jsonl"), "--tokenizer", str(folder), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    _one_line_error(capsys, "chat.jsonl: no records")
    assert not sidecar_path(tmp_path / "o" / "train.bin").exists()
