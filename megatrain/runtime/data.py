"""Token data: the byte tokenizer, token files on disk, and the batches a training step reads.

Where it sits: the runtime's input. `megatrain prepare` (runtime/corpus.py) turns text into `train.bin` /
`val.bin`; `TokenFile.open` memory-maps one and validates it; `Batcher.batch(step)` draws the micro-batches of
one optimizer step, a pure function of (seed, step), so resuming at step k needs only k and the seed.
Run its tests: `.venv/bin/pytest tests/runtime/test_data.py`.

A token file is a raw little-endian array (`.bin`) of uint16 or uint32 token ids with a JSON sidecar
`<file>.json`: {"dtype", "n_tokens", "vocab_size", "tokenizer", "source", "sha256", ...}. The tokenizer is
byte-level: token = byte value, vocabulary 256; each document ends with token 0 (NUL never occurs in text).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from megatrain.files import read_json

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 256
DOC_END = 0  # the token that ends every document in a prepared file
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `megatrain prepare --out DIR` (default corpus) or `megatrain prepare TEXT_FILES... --out DIR`"
_MAX_CHUNK = 1 << 24  # tokens per chunk when scanning a file (32 MiB of uint16)
FINGERPRINT_WHOLE_BYTES = 1 << 30  # data files up to 1 GiB are hashed whole for a resume's check
FINGERPRINT_SAMPLES = 256  # larger ones: 256 blocks of 1 MiB
_BLOCK = 1 << 20


class DataError(ValueError):
    """A user-fixable problem with data files or data settings; the message names the file and the fix."""


# -- the byte tokenizer -------------------------------------------------------------------------------------
def encode(text: str) -> np.ndarray:
    """Text to tokens: its UTF-8 bytes, as uint16."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    """Tokens (any integer array or tensor of byte values) to text; invalid UTF-8 becomes U+FFFD."""
    if hasattr(tokens, "numpy"):  # a torch tensor
        tokens = tokens.cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"byte tokens must be in [0, {VOCAB_SIZE}), got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# -- token files --------------------------------------------------------------------------------------------
def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


class TokenFile:
    """A memory-mapped token file with its sidecar metadata. Open with `TokenFile.open(path, vocab_size)`."""

    hint = PREPARE_HINT

    def __init__(self, path: Path, tokens: np.ndarray, meta: dict,
                 examples: tuple[np.ndarray, np.ndarray] | None = None):
        self.path = path
        self.tokens = tokens  # read-only memmap (or an empty array for a file with no tokens)
        self.meta = meta
        self.examples = examples  # (offsets, loss mask) of an instruction-data file (runtime/examples.py)
        self._max: int | None = None
        self._fingerprint: dict | None = None
        self.cache: dict = {}  # what readers derive from the file once (runtime/examples.py's answer counts)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size the file was prepared for (its sidecar), not necessarily the model's."""
        return self.meta.get("vocab_size")

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.n_tokens:,} {self.dtype} tokens)"

    @classmethod
    def open(cls, path: str | Path, vocab_size: int | None = None) -> TokenFile:
        """Memory-map a token file and check it against its sidecar and, if given, the model's vocab size."""
        path = Path(path)
        if path.is_dir():
            raise DataError(f"{path}: is a folder; pass its token file (e.g. {path / 'train.bin'}), written by "
                            "`megatrain prepare`")
        if not path.is_file():
            raise DataError(f"{path}: token file not found; {PREPARE_HINT}")
        side = sidecar_path(path)
        if not side.is_file():
            raise DataError(f"{path}: its sidecar {side.name} is missing; re-create both: {PREPARE_HINT}")
        meta = read_sidecar(side)
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise DataError(f"{side}: unknown dtype {meta['dtype']!r}; token files hold one of "
                            f"{', '.join(DTYPES)}; re-create it with {PREPARE_HINT}")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{path}: {size} bytes is not a whole number of {meta['dtype']} tokens "
                            f"({dtype.itemsize} bytes each): the file is truncated or corrupt; {PREPARE_HINT}")
        n = size // dtype.itemsize
        if n != meta["n_tokens"]:
            raise DataError(f"{path}: holds {n} tokens but its sidecar says {meta['n_tokens']}: the file and its "
                            f"sidecar do not belong together; {PREPARE_HINT}")
        tokens = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        token_file = cls(path, tokens, meta, _open_examples(path, meta, n) if "examples" in meta else None)
        if vocab_size is not None and n:
            top = token_file.max_token()
            if top >= vocab_size:
                raise DataError(f"{path}: holds token id {top} but the model's vocab_size is {vocab_size}; "
                                f"prepare the data with the model's tokenizer ({meta.get('tokenizer', 'unknown')} "
                                f"here, vocab {meta.get('vocab_size', '?')}) or use a model with a larger vocab")
        return token_file

    def fingerprint(self) -> dict:
        """A hash of the data's bytes (and of an example file's mask and offsets), computed once: the whole
        files up to FINGERPRINT_WHOLE_BYTES, else their sizes and FINGERPRINT_SAMPLES evenly spaced 1 MiB
        blocks ("sampled-sha256": a change outside the blocks goes unseen, at a cost of seconds, not hours)."""
        if self._fingerprint is None:
            parts = [self.path] + ([self.path.with_name(self.meta["examples"][k]) for k in ("offsets", "mask")]
                                   if self.examples is not None else [])
            sizes = [p.stat().st_size for p in parts]
            whole = sum(sizes) <= FINGERPRINT_WHOLE_BYTES
            digest = hashlib.sha256()
            for p, size in zip(parts, sizes):
                digest.update(f"{p.name}\0{size}\0".encode())
                with open(p, "rb") as f:
                    if whole:
                        while chunk := f.read(1 << 24):
                            digest.update(chunk)
                        continue
                    for k in range(FINGERPRINT_SAMPLES):
                        f.seek(k * max(0, size - _BLOCK) // (FINGERPRINT_SAMPLES - 1))
                        digest.update(f.read(_BLOCK))
            self._fingerprint = {"kind": "sha256" if whole else "sampled-sha256", "sha256": digest.hexdigest()}
        return self._fingerprint

    def max_token(self) -> int:
        """The largest token id, by a vectorised max over chunks (bounded memory on huge files)."""
        if self._max is None:
            if not self.n_tokens:
                raise DataError(f"{self.path}: holds no tokens; {PREPARE_HINT}")
            self._max = max(int(self.tokens[i:i + _MAX_CHUNK].max()) for i in range(0, self.n_tokens, _MAX_CHUNK))
        return self._max

    def verify(self) -> None:
        """Check the file's bytes against the sha256 in its sidecar (reads the whole file)."""
        expected = self.meta.get("sha256")
        if expected is None:
            raise DataError(f"{sidecar_path(self.path)}: records no sha256 to verify against; {PREPARE_HINT}")
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            raise DataError(f"{self.path}: contents do not match the sha256 in its sidecar: the file changed "
                            f"or is corrupt; {PREPARE_HINT}")


class _ExampleFiles(BaseModel):
    model_config = ConfigDict(extra="allow")
    n_examples: StrictInt = Field(ge=0)
    mask: StrictStr
    offsets: StrictStr


class Sidecar(BaseModel):
    """What a token file's sidecar must hold, with its types (strict: a string is not a number). Other keys
    (source, split, seed, ...) are kept as they are."""

    model_config = ConfigDict(extra="allow")
    dtype: StrictStr
    n_tokens: StrictInt = Field(ge=0)
    vocab_size: StrictInt | None = Field(None, gt=0)
    tokenizer: StrictStr | None = None
    tokenizer_sha256: StrictStr | None = None
    sha256: StrictStr | None = None
    n_documents: StrictInt | None = Field(None, ge=0)
    examples: _ExampleFiles | None = None


def read_sidecar(side: Path) -> dict:
    """A sidecar, validated (Sidecar), as a dict; any problem is one line naming the file and the field."""
    data = read_json(side, 16 << 20, "a token-file sidecar", DataError, f"re-create it with {PREPARE_HINT}")
    if not isinstance(data, dict):
        raise DataError(f"{side}: needs an object with 'dtype' and 'n_tokens'; re-create it with {PREPARE_HINT}")
    try:
        return Sidecar.model_validate(data).model_dump(exclude_none=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "sidecar"
        raise DataError(f"{side}: {where}: {err['msg']}; re-create it with {PREPARE_HINT}") from None


def _open_examples(path: Path, meta: dict, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The (offsets, mask) memmaps an instruction-data sidecar names, checked against the token file."""
    side = sidecar_path(path)
    ex = meta["examples"]
    if not isinstance(ex, dict) or not all(isinstance(ex.get(k), str) for k in ("mask", "offsets")):
        raise DataError(f"{side}: 'examples' must name its 'mask' and 'offsets' files; {PREPARE_HINT}")
    arrays = []
    for key, dtype, want in (("offsets", np.dtype("<u8"), None), ("mask", np.dtype("u1"), n_tokens)):
        name = ex[key]
        part = path.with_name(name)
        if Path(name).name != name or not part.is_file():
            raise DataError(f"{side}: its {key} file {name!r} is missing beside {path.name}; {PREPARE_HINT}")
        size = part.stat().st_size
        if size % dtype.itemsize or (want is not None and size // dtype.itemsize != want):
            raise DataError(f"{part}: {size} bytes do not fit {n_tokens} tokens' {key}: the files do not belong "
                            f"together; {PREPARE_HINT}")
        arrays.append(np.memmap(part, dtype=dtype, mode="r") if size else np.zeros(0, dtype))
    offsets, mask = arrays
    if len(offsets) < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens or np.any(np.diff(offsets) == 0) \
            or np.any(offsets[1:] < offsets[:-1]):
        raise DataError(f"{path.with_name(ex['offsets'])}: example offsets must rise from 0 to the {n_tokens} "
                        f"tokens of {path.name}; {PREPARE_HINT}")
    return offsets, mask


# -- batches ------------------------------------------------------------------------------------------------
def check_sizes(token_file: TokenFile, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int | np.integer) or value <= 0:
            raise DataError(f"{name} must be a positive integer, got {value!r}")
    need = sizes["seq_len"] + 1
    if token_file.n_tokens < need:
        raise DataError(f"{token_file.path}: holds {token_file.n_tokens} tokens, fewer than seq_len + 1 = {need}; "
                        "use a shorter --seq-len or more data")


def _windows(token_file: TokenFile, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens at `starts`: (tokens, targets), int64 (B, T), targets shifted by one."""
    rows = np.stack([np.asarray(token_file.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    import torch  # NOTE: lazily, so `megatrain --help` and `megatrain prepare` start without torch

    window = torch.from_numpy(rows)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class Batcher:
    """The training batches of each optimizer step: `n_micro_batches` micro-batches of `micro_batch` random
    windows of `seq_len` tokens.

    Window starts come from a numpy Generator seeded by (seed, step), so `batch(step)` is a pure function of
    them: it does not depend on which steps were drawn before. Resuming at step k = the same seed and
    settings, then `batch(k)`; `state(step)` records them and `check_state` compares a checkpoint's record.
    """

    def __init__(self, token_file: TokenFile, micro_batch: int, seq_len: int, n_micro_batches: int, seed: int = 0):
        check_sizes(token_file, micro_batch=micro_batch, seq_len=seq_len, n_micro_batches=n_micro_batches)
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise DataError(f"the data seed must be an integer >= 0, got {seed!r}")
        self.token_file = token_file
        self.micro_batch, self.seq_len, self.n_micro_batches, self.seed = micro_batch, seq_len, n_micro_batches, seed

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.n_micro_batches

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (tokens, targets) pair per micro-batch, each int64 (micro_batch, seq_len)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        high = self.token_file.n_tokens - self.seq_len  # exclusive: the last window ends at the last token
        starts = rng.integers(0, high, size=(self.n_micro_batches, self.micro_batch))
        return [_windows(self.token_file, row, self.seq_len) for row in starts]

    KEYS = ("seed", "micro_batch", "seq_len", "n_micro_batches", "n_tokens", "sha256")

    def state(self, step: int) -> dict:
        """What a checkpoint stores to resume the data order at `step`: the seed and the step suffice; the
        data's own fingerprint tells whether the file is still the one trained on."""
        return {
            "seed": self.seed, "step": step, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
            "n_micro_batches": self.n_micro_batches, "data": str(self.token_file.path),
            "n_tokens": self.token_file.n_tokens, "sha256": self.token_file.meta.get("sha256"),
            "fingerprint": self.token_file.fingerprint(),
        }

    def check_state(self, state: dict, allow_data_change: bool = False) -> None:
        """Raise DataError if a checkpoint's data state would not continue the same data order here."""
        check_data_state(state, self.state(state.get("step", 0)), self.KEYS, allow_data_change)


def check_data_state(theirs: dict, mine: dict, keys: tuple[str, ...], allow_data_change: bool) -> None:
    """Compare a checkpoint's data state with this run's: the order's settings must match; the data's bytes
    (its fingerprint) must too, unless `allow_data_change` (a deliberate switch of data at a resume)."""
    diffs = [f"{k} {theirs.get(k)!r} vs {mine[k]!r}" for k in keys if theirs.get(k) != mine[k]]
    if diffs:
        other = any(theirs.get(k) != mine[k] for k in ("n_tokens", "sha256"))
        raise DataError(f"resuming with a different data order ({'; '.join(diffs)}: checkpoint vs this run); "
                        "resume with the checkpoint's data file and settings" + (
                            " (--allow-data-change covers bytes edited under the same sidecar, not other data: to "
                            "train these weights on new data, `megatrain export` the checkpoint and start a run "
                            "from the export with --model)" if other else ""))
    fp = theirs.get("fingerprint")
    if fp is not None and fp != mine["fingerprint"] and not allow_data_change:
        raise DataError(f"{mine['data']}: its bytes changed since the checkpoint was written ({fp.get('kind')} "
                        f"{str(fp.get('sha256'))[:16]}... then, {mine['fingerprint']['sha256'][:16]}... now), though "
                        "its sidecar did not; resume with the data trained on, or pass --allow-data-change")


def eval_batches(token_file: TokenFile, micro_batch: int, seq_len: int, n_batches: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: n_batches * micro_batch windows evenly spaced over the file."""
    check_sizes(token_file, micro_batch=micro_batch, seq_len=seq_len, n_batches=n_batches)
    last = token_file.n_tokens - seq_len - 1
    starts = np.linspace(0, last, n_batches * micro_batch).round().astype(np.int64)
    return [_windows(token_file, row, seq_len) for row in starts.reshape(n_batches, micro_batch)]


__all__ = [
    "DOC_END", "VOCAB_SIZE", "Batcher", "DataError", "TokenFile", "decode", "encode", "eval_batches",
    "sidecar_path",
]
