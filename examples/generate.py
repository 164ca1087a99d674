"""Generate with transformers from a model folder `megatrain export` wrote: the proof it loads as any other.

Where it sits: the last step of the fine-tuning walk-through (docs/FINETUNING.md). Try it:
`.venv/bin/python examples/generate.py out/tiny-llama-sft "What does os.path.join do?"` (needs the `hf` extra).
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: generate.py MODEL_DIR PROMPT")
    folder, prompt = sys.argv[1:]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    chat = [{"role": "user", "content": prompt}]
    if tok.chat_template:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    print(f"{prompt}\n-> {tok.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
