"""Instruction data on disk and in batches: examples with a loss mask, packed into sequences.

Where it sits: `megatrain prepare` (corpus.py) writes an example token file from chat or alpaca JSONL
(runtime/chat.py renders and masks each example); `TokenFile.open` (data.py) finds its `examples` sidecar
entry; the Trainer draws training batches from `ExampleBatcher` instead of `Batcher` (random windows of a
token stream). Run its tests: `.venv/bin/pytest tests/runtime/test_examples.py`.

On disk, next to `train.bin` (the examples' tokens back to back) and its sidecar:
- `train.bin.mask`: one uint8 per token, 1 where the token is a target (an assistant's token: the loss
  covers those only);
- `train.bin.offsets`: uint64, each example's first token and then the end, n_examples + 1 values.
The sidecar's `examples` object holds their names, sizes and sha256.

In a batch, an example of n tokens is n input positions whose targets are the next token where the mask says
so and -100 elsewhere (the last position has none). With packing (the default), examples fill each row of
`seq_len` in order until the next one does not fit; the rest of the row is padding, a document of its own
whose targets are all -100. Positions restart at 0 in every document, and the model attends only within a
document (models/layers.py `packing`), so a packed example's loss equals the example's loss alone.
Without packing each row holds one example and padding. An example longer than seq_len keeps its first
seq_len tokens (the batcher counts them in `truncated`); one that keeps no target that way (its answer lies
wholly past seq_len) is left out of the order (counted in `dropped`), so no step is ever all padding and no
answer is lost without a word: the training batcher prints `note` once.

Order: each epoch takes the examples in a permutation drawn from (seed, epoch) and packs them; steps take the
rows of epoch after epoch in order, so `batch(step)` is a pure function of (seed, step), and resuming at step
k needs only k (the row counts of earlier epochs are recomputed, cached).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatrain.files import fsync_dir

from .data import DataError, TokenFile, check_data_state, sidecar_path

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
PAD = 0
MASK_CHUNK = 1 << 24  # mask values summed at a time when counting each example's answer tokens


def _rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, pack: bool) -> list[list[int]]:
    """Example ids per row, in `order`: greedy sequential packing (or one example a row)."""
    if not pack:
        return [[int(i)] for i in order]
    rows, current, used = [], [], 0
    for i in order:
        n = min(int(lengths[i]), seq_len)
        if current and used + n > seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(int(i))
        used += n
    if current:
        rows.append(current)
    return rows


class ExampleBatcher:
    """The batches of an example token file: `n_micro_batches` micro-batches of `micro_batch` rows of
    `seq_len` tokens per step; (tokens, targets, positions) packed, (tokens, targets) unpacked."""

    def __init__(self, token_file: TokenFile, micro_batch: int, seq_len: int, n_micro_batches: int, seed: int = 0,
                 pack: bool = True, shuffle: bool = True, drop: bool | None = None):
        if token_file.examples is None:
            raise DataError(f"{token_file.path}: holds a token stream, not examples; prepare instruction data "
                            "from chat or alpaca JSONL with `megatrain prepare FILE.jsonl --tokenizer DIR`")
        for name, v in (("micro_batch", micro_batch), ("seq_len", seq_len), ("n_micro_batches", n_micro_batches)):
            if not isinstance(v, int | np.integer) or v <= 0:
                raise DataError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise DataError(f"the data seed must be an integer >= 0, got {seed!r}")
        self.token_file = token_file
        self.offsets, self.mask = token_file.examples
        self.lengths = np.diff(self.offsets)
        if not len(self.lengths):
            raise DataError(f"{token_file.path}: holds no examples; {token_file.hint}")
        self.micro_batch, self.seq_len, self.n_micro_batches = micro_batch, seq_len, n_micro_batches
        self.seed, self.pack, self.shuffle = seed, pack, shuffle
        self.truncated = int((self.lengths > seq_len).sum())
        answered = np.flatnonzero(answer_counts(token_file, seq_len) > 0)
        # the training order (shuffled) leaves out what would be all padding; a fixed order keeps every example
        # unless asked (drop), so the rows of a file stay its examples
        self.kept = answered if (shuffle if drop is None else drop) else np.arange(len(self.lengths))
        self.dropped = len(self.lengths) - len(self.kept)
        if not len(answered):
            raise DataError(f"{token_file.path}: none of its {len(self.lengths):,} examples keeps an answer token "
                            f"within --seq-len {seq_len} (the answers lie past it, or there are none); raise "
                            "--seq-len, or prepare shorter examples")
        if shuffle and self.note:
            print(f"note: {self.note}", file=sys.stderr, flush=True)
        self._epochs: list[list[list[int]]] = []
        self._starts = [0]  # first global row of each epoch

    @property
    def note(self) -> str:
        """What seq_len cuts from these examples, in one line ("" when nothing)."""
        if not self.truncated:
            return ""
        total = len(self.lengths)
        text = (f"{self.token_file.path.name}: {self.truncated:,} of {total:,} examples are longer than --seq-len "
                f"{self.seq_len} and keep their first {self.seq_len} tokens")
        if self.dropped:
            left = np.setdiff1d(np.arange(total), self.kept)[:5].tolist()
            text += (f"; {self.dropped:,} keep no answer token within it and are left out (example "
                     f"{', '.join(map(str, left))}{', ...' if self.dropped > 5 else ''})")
        return text + "; a larger --seq-len keeps them whole"

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.n_micro_batches

    def _epoch(self, e: int) -> list[list[int]]:
        while len(self._epochs) <= e:
            k = len(self._epochs)
            # a permutation of the kept examples: with none dropped, the order of every earlier release
            order = self.kept[np.random.default_rng([self.seed, k]).permutation(len(self.kept))] if self.shuffle \
                else self.kept
            self._epochs.append(_rows(self.lengths, order, self.seq_len, self.pack))
            self._starts.append(self._starts[-1] + len(self._epochs[-1]))
        return self._epochs[e]

    def row(self, r: int) -> list[int]:
        """The example ids of global row r (epochs back to back)."""
        e = 0
        while True:
            self._epoch(e)
            if r < self._starts[e + 1]:
                return self._epochs[e][r - self._starts[e]]
            e += 1

    def epoch_of(self, step: int) -> float:
        """How many passes over the examples the batches before `step` took."""
        r = step * self.rows_per_step
        e = 0
        while True:
            self._epoch(e)
            if r < self._starts[e + 1]:
                return e + (r - self._starts[e]) / len(self._epochs[e])
            e += 1

    def batch(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.rows_per_step
        rows = [self.row(first + i) for i in range(self.rows_per_step)]
        return [self._micro_batch(rows[k:k + self.micro_batch])
                for k in range(0, self.rows_per_step, self.micro_batch)]

    def _micro_batch(self, rows: list[list[int]]) -> tuple[torch.Tensor, ...]:
        import torch  # NOTE: lazily, as data.py

        T = self.seq_len
        tokens = np.full((len(rows), T), PAD, dtype=np.int64)
        targets = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), T), dtype=np.int64)
        for b, row in enumerate(rows):
            t = 0
            for i in row:
                a = int(self.offsets[i])
                n = min(int(self.lengths[i]), T)
                ids = np.asarray(self.token_file.tokens[a:a + n], dtype=np.int64)
                mask = np.asarray(self.mask[a + 1:a + n], dtype=bool)
                tokens[b, t:t + n] = ids
                targets[b, t:t + n - 1] = np.where(mask, ids[1:], IGNORE_INDEX)
                positions[b, t:t + n] = np.arange(n)
                t += n
            positions[b, t:] = np.arange(T - t)  # the padding: a document of its own, never a target
        out = (torch.from_numpy(tokens), torch.from_numpy(targets))
        return (*out, torch.from_numpy(positions)) if self.pack else out

    def state(self, step: int) -> dict:
        return {"seed": self.seed, "step": step, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "n_micro_batches": self.n_micro_batches, "data": str(self.token_file.path),
                "n_tokens": self.token_file.n_tokens, "sha256": self.token_file.meta.get("sha256"),
                "pack": self.pack, "n_examples": len(self.lengths), "n_dropped": self.dropped,
                "fingerprint": self.token_file.fingerprint()}

    def check_state(self, state: dict, allow_data_change: bool = False) -> None:
        keys = ("seed", "micro_batch", "seq_len", "n_micro_batches", "n_tokens", "sha256", "pack", "n_examples")
        if self.dropped or "n_dropped" in state:  # checkpoints from before examples were dropped lack the key
            keys += ("n_dropped",)
        check_data_state(state, self.state(state.get("step", 0)), keys, allow_data_change)


def answer_counts(token_file: TokenFile, seq_len: int) -> np.ndarray:
    """Per example, its targets within the first seq_len tokens (mask[a + 1:a + min(n, seq_len)]), from
    prefix sums of the mask taken a chunk at a time (memory bounded on any file); cached per seq_len."""
    cache = token_file.cache.setdefault("answer_counts", {})
    if seq_len not in cache:
        offsets, mask = token_file.examples
        starts = offsets[:-1].astype(np.int64)
        ends = starts + np.minimum(np.diff(offsets).astype(np.int64), seq_len)
        points = np.concatenate([starts + 1, ends])
        prefix = np.zeros(len(points), dtype=np.int64)  # sum of mask[:p] for each point p
        order = np.argsort(points, kind="stable")
        sorted_points = points[order]
        total = 0
        for c in range(0, len(mask), MASK_CHUNK):
            part = np.cumsum(np.asarray(mask[c:c + MASK_CHUNK], dtype=np.int64))
            lo = np.searchsorted(sorted_points, c + 1, side="left")
            hi = np.searchsorted(sorted_points, c + len(part), side="right")
            prefix[order[lo:hi]] = total + part[sorted_points[lo:hi] - c - 1]
            total += int(part[-1]) if len(part) else 0
        n = len(starts)
        cache[seq_len] = np.maximum(prefix[n:] - prefix[:n], 0)
    return cache[seq_len]


def example_eval_batches(token_file: TokenFile, micro_batch: int, seq_len: int, n_batches: int,
                         pack: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """Fixed validation batches: the first rows of the examples in file order (no shuffling), less those with
    no answer token within seq_len (a batch of padding alone has no loss to measure)."""
    batcher = ExampleBatcher(token_file, micro_batch, seq_len, n_batches, seed=0, pack=pack, shuffle=False, drop=True)
    n_rows = min(n_batches * micro_batch, len(batcher._epoch(0)))
    n = max(1, n_rows // micro_batch)
    rows = [batcher.row(i % len(batcher._epoch(0))) for i in range(n * micro_batch)]
    return [batcher._micro_batch(rows[k:k + micro_batch]) for k in range(0, n * micro_batch, micro_batch)]


def write_example_file(path: str | Path, examples: Iterable[tuple[list[int], list[int]]], vocab_size: int,
                       **meta) -> Path:
    """Atomically write `examples` ((token ids, 0/1 target mask) pairs) as an example token file: the tokens
    (uint16, or uint32 past 65,535 ids), the mask, the offsets and the sidecar (`meta` added to it)."""
    path = Path(path)
    dtype = np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
    names = {"tokens": path, "mask": path.with_name(path.name + ".mask"),
             "offsets": path.with_name(path.name + ".offsets")}
    side = sidecar_path(path)
    tmp = {k: p.with_name(f".{p.name}.tmp-{os.getpid()}") for k, p in {**names, "side": side}.items()}
    digests = {k: hashlib.sha256() for k in names}
    offsets, n_examples = [0], 0
    try:
        with open(tmp["tokens"], "wb") as ft, open(tmp["mask"], "wb") as fm:
            for ids, mask in examples:
                ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask)
                if len(ids) != len(mask) or not len(ids):
                    raise DataError(f"{path}: example {n_examples} has {len(ids)} tokens and {len(mask)} mask "
                                    "values; each example needs at least one token and one mask value per token")
                if ids.max() >= vocab_size or ids.min() < 0:
                    raise DataError(f"{path}: example {n_examples} holds token id {ids.max()} outside the "
                                    f"tokenizer's vocabulary of {vocab_size}")
                for f, key, arr in ((ft, "tokens", np.asarray(ids, dtype=dtype)),
                                    (fm, "mask", np.asarray(mask, dtype=np.uint8))):
                    data = arr.tobytes()
                    f.write(data)
                    digests[key].update(data)
                offsets.append(offsets[-1] + len(ids))
                n_examples += 1
            for f in (ft, fm):
                f.flush()
                os.fsync(f.fileno())
        data = np.asarray(offsets, dtype="<u8").tobytes()
        digests["offsets"].update(data)
        with open(tmp["offsets"], "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        sidecar = {"dtype": "uint16" if dtype.itemsize == 2 else "uint32", "n_tokens": offsets[-1],
                   "vocab_size": vocab_size, "sha256": digests["tokens"].hexdigest(), "n_documents": n_examples,
                   **meta,
                   "examples": {"n_examples": n_examples, "mask": names["mask"].name, "offsets": names["offsets"].name,
                                "mask_sha256": digests["mask"].hexdigest(),
                                "offsets_sha256": digests["offsets"].hexdigest()}}
        with open(tmp["side"], "w") as f:
            json.dump(sidecar, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        side.unlink(missing_ok=True)  # the new data files must never meet an old sidecar
        for key in ("tokens", "mask", "offsets"):
            os.replace(tmp[key], names[key])
        os.replace(tmp["side"], side)
        fsync_dir(path.parent)
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return path
