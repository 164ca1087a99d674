"""A Llama-2-style tokenizer folder (saved by transformers 4: a normalizer that prepends "▁" and no
pre-tokenizer, tokenizer_class LlamaTokenizer) tokenizes as the installed transformers does: transformers 5
rebuilds a Llama tokenizer's pipeline rather than reading it from tokenizer.json, and so do we; a Llama
tokenizer that cannot be rebuilt so is refused naming the difference. Built locally, nothing downloaded."""

import json

import pytest

from megatrain.runtime import chat
from megatrain.runtime.data import DataError
from megatrain.runtime.tokenizer import Tokenizer

# Llama-2-chat's template, as its tokenizer_config.json holds it
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
          "{% endif %}{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}"
          "{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And  the  next one?"},
                {"role": "assistant", "content": "Then 5, in the return value."}]


def _llama2_folder(folder, bpe_text, model="BPE"):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, processors, trainers

    if model == "BPE":
        backend = Backend(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    else:
        backend = Backend(models.WordLevel(unk_token="<unk>"))
        trainer = trainers.WordLevelTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                            show_progress=False)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.train_from_iterator(bpe_text, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "legacy": False, "add_bos_token": True, "add_eos_token": False, "chat_template": LLAMA2,
              "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


TEXT = ["What is two plus two? It is four. And the next one? Then five, in the return value.",
        "Be brief. The system says so, and the user asks again and again."] * 20


def test_llama2_folders_tokenize_as_the_installed_transformers(tmp_path, transformers_lib):
    folder = _llama2_folder(tmp_path / "llama2", TEXT)
    hf = transformers_lib.AutoTokenizer.from_pretrained(folder)
    tok = Tokenizer.from_dir(folder)
    want = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    ids, mask = chat.chat_example(tok, CONVERSATION)
    assert ids == want
    assert tok.decode([t for t, m in zip(ids, mask) if m]).count("</s>") == 2  # both answers, each with its eos
    for text in ("Then five, in the return value.", " leading space", "two\n\nlines  here"):
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert tok.encode_documents([text])[0] == hf(text)["input_ids"], text


def test_a_llama_tokenizer_that_transformers_would_rebuild_otherwise_is_refused(tmp_path):
    folder = _llama2_folder(tmp_path / "wordlevel", TEXT, model="WordLevel")
    with pytest.raises(DataError, match="whose model is WordLevel, not BPE") as e:
        Tokenizer.from_dir(folder)
    assert "\n" not in str(e.value)
