"""`megatrain prepare`: text, instruction JSONL or the default corpus into train/val token files
(megatrain/runtime/corpus.py does the work)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatrain.files import input_path
from megatrain.runtime.corpus import DEFAULT_CORPUS_CAP_BYTES, DataError, prepare, sidecar_path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare", help="tokenize text files, instruction JSONL or the default corpus into train/val token files",
        description="Tokenize text into TOKEN_DIR/train.bin and val.bin, each with a JSON sidecar, with the byte "
                    "tokenizer (vocab 256) or a Hugging Face model folder's tokenizer.json (--tokenizer). A document "
                    "is one file; the split is by document, deterministic in --seed. JSONL files are instruction "
                    "data: one chat ({\"messages\": [{\"role\", \"content\"}, ...]}, rendered with the tokenizer's chat "
                    "template) or Alpaca ({\"instruction\", \"input\", \"output\"}) record per line, trained on the "
                    "assistant's tokens only. With no files, the default corpus: the Python standard library's .py "
                    f"sources (about {DEFAULT_CORPUS_CAP_BYTES / 1e6:.0f} MB).")
    p.add_argument("inputs", nargs="*", metavar="FILES", type=input_path,
                   help="text files or folders (every non-hidden file inside), or .jsonl instruction files; none: "
                   "the default corpus")
    p.add_argument("--out", required=True, metavar="DIR", type=input_path,
                   help="folder to write train.bin and val.bin into")
    p.add_argument("--tokenizer", metavar="MODEL_DIR", type=input_path, help="a Hugging Face model folder whose tokenizer.json (and "
                   "chat template) to use (default: bytes)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="fraction of documents (or examples) held out for validation, in [0, 1) (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="the --seq-len you will train with: instruction examples longer than it are counted, and "
                   "those whose answer lies wholly past it are dropped (named by file and line)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_prepare)
    return p


def run_prepare(args) -> int:
    out = Path(args.out).resolve()
    written = {out / f"{part}.bin{ext}" for part in ("train", "val") for ext in ("", ".json", ".mask", ".offsets")}
    for path in (*args.inputs, *([args.tokenizer] if args.tokenizer else [])):
        p = Path(path).resolve()
        if out == p or (p.is_dir() and p in out.parents) or p in written:
            raise DataError(f"--out {args.out} overlaps the input {path}: the token files would overwrite it or be "
                            "read back as input next time; choose a folder apart")
    paths = prepare(args.inputs or None, args.out, args.val_fraction, args.seed, tokenizer=args.tokenizer,
                    progress=not args.no_progress, seq_len=args.seq_len)
    cut = json.loads(sidecar_path(paths[0]).read_text()).get("cut")
    for name, path in zip(("train", "val"), paths):
        meta = json.loads(sidecar_path(path).read_text())
        what = (f"{meta['examples']['n_examples']:,} example(s)" if "examples" in meta
                else f"{meta['n_documents']} document(s)")
        print(f"{name:>5}: {path}  {meta['n_tokens']:,} tokens, {what}")
    print(f"source: {meta['source']}; tokenizer: {meta['tokenizer']} (vocab {meta['vocab_size']:,})")
    if cut is not None:
        print(_cut_line(cut))
    return 0


def _cut_line(cut: dict) -> str:
    """What --seq-len cut, or the longest example when no --seq-len was given."""
    if "seq_len" not in cut:
        return (f"longest example: {cut['longest']:,} tokens (pass --seq-len to count what a shorter --seq-len "
                "would cut)")
    line = f"--seq-len {cut['seq_len']}: {cut['truncated']:,} example(s) longer (training keeps their first {cut['seq_len']} tokens)"
    if cut["dropped"]:
        named = ", ".join(cut["dropped_lines"]) + (", ..." if cut["dropped"] > len(cut["dropped_lines"]) else "")
        line += f"; dropped {cut['dropped']:,} of them whose answer lies wholly past it ({named})"
    return line + (f"; longest {cut['longest']:,} tokens" if cut["truncated"] else "")
