"""`megatrain prepare`: text files (or the built-in default corpus) to train/val token files.

Where it sits: before training. `prepare(inputs, out_dir)` tokenizes text with the byte tokenizer of
runtime/data.py and writes `train.bin` / `val.bin` with their sidecars; training opens them with
`TokenFile.open`. Try it: `megatrain prepare --out corpus` (the default corpus, a few seconds).
Run its tests: `.venv/bin/pytest tests/runtime/test_data.py`.

- A document is one input file (folders are expanded to the regular, non-hidden files inside them). The split
  is by document, from a stable hash (sha256) of the document's path relative to the inputs' common folder and
  the seed, not on Python's hash(); documents are written in sorted order of that path, so the output
  depends on the set of inputs, not their order. With a single document
  the validation split is instead its last `val_fraction` of bytes, cut at a line start (else a word, else
  a character: never inside a UTF-8 character).
- Instruction JSONL: every record is checked before any is tokenized; an empty file is refused; with
  `seq_len`, examples longer than it are counted and those whose answer lies wholly past it dropped, named
  by file and line (the sidecar's `cut`); the sidecar records the chat template's hash beside the tokenizer's.
- Writes are atomic: each file is written under a temporary name, fsynced and renamed, and the old sidecar
  is removed first, so an interrupted prepare leaves the previous files, or a .bin without a sidecar (which
  `TokenFile.open` rejects), never a half-written file under the final name.
- The default corpus is real text on any machine with Python: the standard library's own .py sources, in
  sorted order of relative path, without test folders and site-packages, up to DEFAULT_CORPUS_CAP_BYTES.
  `cached_default_corpus()` prepares it once under $MEGATRAIN_CACHE (default ~/.cache/megatrain).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from megatrain.files import cache_error, cache_root, fsync_dir, pid_alive, remove_tree

from .data import DOC_END, DataError, TokenFile, sidecar_path
from .tokenizer import Tokenizer

DEFAULT_CORPUS_CAP_BYTES = 8_000_000
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_FORMAT_VERSION = 1  # part of the cache key: bump when the prepared bytes for the same inputs change


# -- inputs -------------------------------------------------------------------------------------------------
def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(cap_bytes: int = DEFAULT_CORPUS_CAP_BYTES) -> list[Path]:
    """The standard library's .py files in sorted order of relative path, until the next would pass the cap."""
    root = default_corpus_root()
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    files, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size > cap_bytes:
            break
        files.append(path)
        total += size
    return files


def _expand(inputs: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            inside = [
                Path(folder, n)
                for folder, dirs, names in os.walk(path)
                if not any(part.startswith(".") for part in Path(folder).relative_to(path).parts)
                for n in names
                if not n.startswith(".")
            ]
            files += sorted(p for p in inside if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: input not found; pass existing text files or folders to `megatrain prepare`")
    unique = list(dict.fromkeys(p.resolve() for p in files))
    if not unique:
        raise DataError("no input files found (empty folders?); pass text files, or none for the default corpus")
    return unique


def _relative_names(files: list[Path]) -> list[str]:
    root = Path(os.path.commonpath([p.parent for p in files]))
    return [p.relative_to(root).as_posix() for p in files]


def _unit_hash(seed: int, name: str) -> float:
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(names: list[str], val_fraction: float, seed: int) -> list[bool]:
    """Per document, True if it goes to validation: hash(seed, name) < val_fraction, but never an empty
    side when there are two documents or more and val_fraction > 0."""
    u = [_unit_hash(seed, n) for n in names]
    is_val = [x < val_fraction for x in u]
    if val_fraction > 0 and len(names) >= 2:
        if not any(is_val):
            is_val[u.index(min(u))] = True
        if all(is_val):
            is_val[u.index(max(u))] = False
    return is_val


# -- writing ------------------------------------------------------------------------------------------------
def write_token_file(path: str | Path, documents: Iterable[bytes | np.ndarray], source: str,
                     tokenizer: Tokenizer | None = None, **extra) -> Path:
    """Atomically write the tokens of `documents` and the sidecar. With the byte tokenizer (the default) a
    document is raw bytes, written as its byte values then DOC_END; otherwise it is an array of token ids that
    already ends with the tokenizer's eos. uint16 tokens, or uint32 for a vocabulary past 65,536 ids."""
    tok = tokenizer or Tokenizer.bytes()
    path = Path(path)
    side = sidecar_path(path)
    dtype = np.dtype("<u2") if tok.vocab_size <= 2**16 else np.dtype("<u4")
    tmp, tmp_side = (p.with_name(f".{p.name}.tmp-{os.getpid()}") for p in (path, side))
    digest, n_tokens, n_docs = hashlib.sha256(), 0, 0
    try:
        with open(tmp, "wb") as f:
            for doc in documents:
                if isinstance(doc, bytes | bytearray):
                    doc = np.frombuffer(bytes(doc) + bytes([DOC_END]), dtype=np.uint8)
                tokens = np.asarray(doc).astype(dtype).tobytes()
                f.write(tokens)
                digest.update(tokens)
                n_tokens += len(doc)
                n_docs += 1
            f.flush()
            os.fsync(f.fileno())
        meta = {"dtype": "uint16" if dtype.itemsize == 2 else "uint32", "n_tokens": n_tokens,
                "vocab_size": tok.vocab_size, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256,
                "source": source, "sha256": digest.hexdigest(), "n_documents": n_docs, **extra}
        with open(tmp_side, "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        side.unlink(missing_ok=True)  # a new .bin must never meet an old sidecar
        os.replace(tmp, path)
        os.replace(tmp_side, side)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_side.unlink(missing_ok=True)
    return path


def _encoded(docs: Iterable[bytes], tok: Tokenizer, bar=None) -> Iterable[bytes | np.ndarray]:
    """Documents for write_token_file: raw bytes for the byte tokenizer, else token ids (+ eos) encoded in
    batches, which the tokenizers library spreads over every core."""
    if tok.sha256 is None:
        for doc in docs:
            yield doc
            bar and bar(len(doc))
        return
    if tok.eos_id is None:
        raise DataError(f"{tok.name}: the tokenizer names no eos token to end each document with; set eos_token "
                        "in tokenizer_config.json")
    batch: list[bytes] = []

    def flush():
        # as `tokenizer(text)` encodes a document: its post-processor's bos (and eos) where it adds them
        for ids in tok.encode_documents([d.decode("utf-8", errors="replace") for d in batch]):
            yield np.asarray([*ids, tok.eos_id] if not ids or ids[-1] != tok.eos_id else ids, dtype=np.int64)
        bar and bar(sum(len(d) for d in batch))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) >= 256 or sum(len(d) for d in batch) > 1 << 24:
            yield from flush()
    yield from flush()


def _tail_split(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """Split one document: its last val_fraction of bytes go to validation, from the next line start (else
    the next word, else the next character: never inside a UTF-8 character, so neither side holds U+FFFD)."""
    cut = int(len(data) * (1 - val_fraction))
    for sep in (b"\n", b" ", b"\t"):
        at = data.find(sep, cut)
        if at != -1 and at + 1 < len(data):
            return data[:at + 1], data[at + 1:]
    while cut < len(data) and data[cut] & 0xC0 == 0x80:  # a continuation byte: the character began earlier
        cut += 1
    return data[:cut], data[cut:]


def prepare(inputs: list[str | Path] | None, out_dir: str | Path, val_fraction: float = 0.05, seed: int = 0,
            tokenizer: str | Path | Tokenizer | None = None, progress: bool = False,
            seq_len: int | None = None) -> tuple[Path, Path]:
    """Tokenize text files (None: the default corpus) into out_dir/train.bin and out_dir/val.bin, with the
    byte tokenizer or a Hugging Face model folder's (`tokenizer`). JSONL inputs are instruction data (chat or
    Alpaca records, runtime/chat.py): each record is one example with its loss mask (runtime/examples.py).
    With `seq_len`, examples longer than it are counted, and those whose answer lies wholly past it dropped
    (the sidecar's `cut` records both)."""
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2):
        raise DataError(f"--seq-len must be an integer >= 2, got {seq_len!r}")
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if seed < 0:
        raise DataError(f"--seed must be >= 0, got {seed}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else (
        Tokenizer.from_dir(tokenizer) if tokenizer is not None else Tokenizer.bytes())
    if inputs is None:
        files = default_corpus_files()
        if not files:
            raise DataError(f"no .py files under {default_corpus_root()} for the default corpus; "
                            "pass text files to `megatrain prepare`")
        root = default_corpus_root()
        names = [p.relative_to(root).as_posix() for p in files]
        source = f"default corpus: {len(files)} .py files of the Python {platform.python_version()} standard library"
    else:
        files = _expand(inputs)
        names = _relative_names(files)
        names, files = map(list, zip(*sorted(zip(names, files))))  # the output depends on the set of inputs only
        source = f"{len(files)} file(s) under {Path(os.path.commonpath([p.parent for p in files]))}"
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a folder; pass a folder to --out")
    jsonl = [p.suffix.lower() == ".jsonl" for p in files]
    if any(jsonl) and not all(jsonl):
        raise DataError(f"{files[jsonl.index(False)]}: a text file among JSONL instruction files; prepare "
                        "instruction data (.jsonl) and text apart, into two --out folders")
    if inputs is not None and not any(jsonl):
        _check_text(files)
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    # Both splits are written into a hidden folder first and moved into `out` together at the end, so a prepare
    # stopped at any point leaves the earlier pair whole (or, killed between the last renames, data files
    # without sidecars, which are refused), never a new train file beside an old val file.
    tmp = out / f".prepare-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _prepare_into(tmp, files, names, jsonl, tok, val_fraction, seed, source, progress, seq_len)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "train.bin", out / "val.bin"


def _remove_stale(out: Path) -> None:
    """The hidden folders of prepares that died before they finished (their pid is gone)."""
    for p in out.glob(".prepare-*"):
        pid = p.name.removeprefix(".prepare-")
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished prepare's files from `tmp` into `out`: the sidecars of the files being replaced first
    (new data never meets an old sidecar), then the data files, then the new sidecars."""
    names = sorted(p.name for p in tmp.iterdir())
    sides = [n for n in names if n.endswith(".json")]
    for n in sides:
        (out / n).unlink(missing_ok=True)
    for n in [n for n in names if not n.endswith(".json")] + sides:
        os.replace(tmp / n, out / n)
    fsync_dir(out)


def _prepare_into(out: Path, files, names, jsonl, tok, val_fraction, seed, source, progress, seq_len) -> None:
    split = {"seed": seed, "val_fraction": val_fraction}
    with _progress(progress, sum(p.stat().st_size for p in files), "tokenize") as bar:
        if all(jsonl):
            _prepare_examples(files, names, out, tok, val_fraction, seed, source, bar, seq_len)
            return
        if len(files) == 1 and val_fraction > 0:
            train_text, val_text = _tail_split(files[0].read_bytes(), val_fraction)
            train_docs, val_docs = [train_text], [val_text] if val_text else []
            how = "tail of the only document"
        else:
            is_val = split_documents(names, val_fraction, seed)
            train_docs = (p.read_bytes() for p, v in zip(files, is_val) if not v)
            val_docs = (p.read_bytes() for p, v in zip(files, is_val) if v)
            how = "by document"
        write_token_file(out / "train.bin", _encoded(train_docs, tok, bar), source, tok, split=f"train ({how})",
                         **split)
        write_token_file(out / "val.bin", _encoded(val_docs, tok, bar), source, tok, split=f"val ({how})", **split)


def _check_text(files: list[Path]) -> None:
    """Text inputs are text: refused, before anything is written, when all are empty or one is binary (a NUL
    byte in its first 8 KiB, git's test)."""
    if not any(p.stat().st_size for p in files):
        raise DataError(f"{files[0] if len(files) == 1 else f'the {len(files)} input files'}: no text to tokenize "
                        "(empty); pass files that hold text")
    for p in files:
        with p.open("rb") as f:
            if b"\0" in f.read(8192):
                raise DataError(f"{p}: a binary file (a NUL byte in its first 8 KiB), not text; pass text files, or "
                                "instruction data as .jsonl")


def _prepare_examples(files: list[Path], names: list[str], out: Path, tok: Tokenizer, val_fraction: float,
                      seed: int, source: str, bar, seq_len: int | None) -> tuple[Path, Path]:
    """Instruction JSONL to example token files; the split is by example, from a hash of (file, line). Every
    record is checked before one is tokenized; then the files are read again, an example at a time."""
    from .chat import example, read_examples
    from .examples import write_example_file

    lines, kinds = [], set()
    for path in files:
        lines.append([])
        for kind, _, n in read_examples(path):
            kinds.add(kind)
            lines[-1].append(n)
    if not any(lines):
        raise DataError(f"{files[0] if len(files) == 1 else f'the {len(files)} input files'}: no records (empty "
                        "or blank lines only); write one chat or Alpaca record per line")
    parts: dict[bool, list] = {False: [], True: []}
    cut = {"longest": 0, "truncated": 0, "dropped": 0, "dropped_lines": []}
    for path, name, numbers in zip(files, names, lines):
        flags = split_documents([f"{name}:{n}" for n in numbers], val_fraction, seed)
        for (kind, record, line), is_val in zip(read_examples(path), flags):
            try:
                ids, mask = example(tok, kind, record)
            except DataError as e:
                raise DataError(f"{path}:{line}: {e}") from None
            cut["longest"] = max(cut["longest"], len(ids))
            if seq_len is not None and len(ids) > seq_len:
                cut["truncated"] += 1
                if not any(mask[1:seq_len]):  # no target left among the first seq_len tokens
                    cut["dropped"] += 1
                    cut["dropped_lines"] += [f"{path.name}:{line}"] if len(cut["dropped_lines"]) < 10 else []
                    continue
            parts[is_val].append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)))
        bar and bar(path.stat().st_size)
    if not parts[False] and not parts[True]:
        raise DataError(f"every example's answer lies past --seq-len {seq_len} (e.g. {cut['dropped_lines'][0]}); "
                        "raise --seq-len")
    meta = {"tokenizer": tok.name, "tokenizer_sha256": tok.sha256, "source": source, "format": "+".join(sorted(kinds)),
            "seed": seed, "val_fraction": val_fraction,
            "cut": {**cut, **({"seq_len": seq_len} if seq_len is not None else {})}}
    if tok.chat_template is not None:  # training refuses the data under another template (tokenizer.py)
        meta["chat_template_sha256"] = tok.chat_template_sha256
    return tuple(write_example_file(out / f"{part}.bin", parts[part == "val"], tok.vocab_size,
                                    split=f"{part} (by example)", **meta) for part in ("train", "val"))


class _progress:
    """A rich progress bar over input bytes (or nothing); entered, it is a callable that advances it."""

    def __init__(self, show: bool, total: int, what: str):
        self.show, self.total, self.what = show, total, what

    def __enter__(self):
        if not self.show:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn(self.what), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        self._bar.start()
        task = self._bar.add_task(self.what, total=self.total)
        return lambda n: self._bar.update(task, advance=n)

    def __exit__(self, *exc) -> None:
        if self.show:
            self._bar.stop()


def cached_default_corpus(val_fraction: float = 0.05, seed: int = 0, tokenizer: str | Path | None = None
                          ) -> tuple[Path, Path]:
    """The prepared default corpus, built once per (file list, Python version, split settings, tokenizer) and
    reused. The cache folder is $MEGATRAIN_CACHE, else ~/.cache/megatrain; the corpus goes in corpus-<key>/."""
    root = default_corpus_root()
    files = default_corpus_files()
    tok = Tokenizer.from_dir(tokenizer) if tokenizer is not None else None
    key = hashlib.sha256()
    key.update(f"{_FORMAT_VERSION}\n{sys.version}\n{val_fraction}\n{seed}\n".encode())
    if tok is not None:
        key.update(f"tokenizer {tok.sha256}\n".encode())
    for p in files:
        key.update(f"{p.relative_to(root).as_posix()}\t{p.stat().st_size}\n".encode())
    cache = cache_root()
    out = cache / f"corpus-{key.hexdigest()[:16]}"
    train, val = out / "train.bin", out / "val.bin"
    if _complete(train, val):
        return train, val
    # NOTE: built in a private folder and renamed into place whole: processes sharing the cache (the ranks of
    # a world) never see a token file without its sidecar, and the first complete copy wins
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=cache))
    except OSError as e:
        raise cache_error(e, "the default corpus") from None
    try:
        prepare(None, tmp, val_fraction, seed, tokenizer=tok)
        try:
            os.rename(tmp, out)
        except OSError:  # another process's copy is in place, or a broken one is in the way
            if not _complete(train, val):
                remove_tree(out)
                os.rename(tmp, out)
    except OSError as e:
        raise cache_error(e, "the default corpus") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return train, val


def _complete(*paths: Path) -> bool:
    """Whether the cached token files are whole: each opens and its bytes match its sidecar's sha256 (a
    spoiled copy in the cache is built again, not blamed on the user's data)."""
    try:
        for path in paths:
            TokenFile.open(path).verify()
    except (DataError, OSError):
        return False
    return True
