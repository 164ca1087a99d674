"""Make a small random Hugging Face Llama to fine-tune, and a chat dataset to fine-tune it on; no download.

Where it sits: the fine-tuning walk-through (docs/FINETUNING.md) starts here (and tests/test_readme_finetune.py runs
it). The tokenizer is a byte-level BPE trained on the Python standard library's source (the built-in corpus),
with ChatML's special tokens and chat template; the model is a LlamaForCausalLM of random weights saved with
`save_pretrained`; the dataset holds one conversation per documented standard-library function: the user
asks what it does, the assistant answers with its docstring's first line.
Try it: `.venv/bin/python examples/tiny_hf_model.py --out out/tiny-llama --chat out/chat.jsonl` (needs the `hf`
extra; out/ is the scratch folder git ignores).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from megatrain.runtime.corpus import default_corpus_files

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def stdlib_texts(limit_bytes: int) -> list[str]:
    texts, size = [], 0
    for path in default_corpus_files():
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(texts[-1])
        if size >= limit_bytes:
            break
    return texts


def make_tokenizer(vocab_size: int, train_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_texts(train_bytes), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def conversations(limit: int) -> list[dict]:
    """One conversation per documented public function of the standard library, in a fixed order."""
    out = []
    for path in default_corpus_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        module = path.stem
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().splitlines()
                if doc and 10 < len(doc[0]) < 200:
                    out.append({"messages": [{"role": "user", "content": f"What does {module}.{node.name} do?"},
                                             {"role": "assistant", "content": doc[0]}]})
                    if len(out) == limit:
                        return out
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--chat", help="also write a chat JSONL dataset here")
    p.add_argument("--examples", type=int, default=2000, help="conversations in the dataset (default 2000)")
    p.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary (default 1024)")
    p.add_argument("--d-model", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    tok = make_tokenizer(args.vocab, train_bytes=400_000)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.d_model, intermediate_size=3 * args.d_model,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote a random LlamaForCausalLM of {n:,} parameters and a {len(tok)}-id tokenizer to {args.out}")
    if args.chat:
        convs = conversations(args.examples)
        Path(args.chat).write_text("".join(json.dumps(c) + "\n" for c in convs))
        print(f"wrote {len(convs)} conversations to {args.chat}")


if __name__ == "__main__":
    main()
