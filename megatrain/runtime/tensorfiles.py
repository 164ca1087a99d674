"""Safetensors files, streamed: written tensor by tensor from their own memory and read straight into the
tensors that receive them, hashed on the way, with every header checked before a byte of data is trusted.

Where it sits: below checkpoints (checkpoint.py: a unit's state per file), Hugging Face weights (hf_load.py:
shards cast into the fp32 masters) and export (export.py). Nothing is unpickled: a safetensors file is an
8-byte header length, a JSON header (names, dtypes, shapes, offsets) and raw little-endian bytes, parsed here
by its spec (safetensors.safe_open reads what this writes). Run its tests:
`.venv/bin/pytest tests/runtime/test_checkpoint.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A stored tensor file or checkpoint that cannot be used; the message names the file, the problem and the
    fix."""


_MAX_HEADER = 100 * 2**20  # the limit the safetensors library enforces
_CHUNK = 1 << 24
ST_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3"}
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor in a declared order: the header first (names, dtypes,
    shapes), then each tensor's bytes straight from its memory, hashed on the way. `close()` fsyncs and
    returns the file's record {"bytes", "sha256"}."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in specs:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        if metadata:
            header["__metadata__"] = metadata
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the reference writer aligns the data to 8 bytes
        self.path, self._specs, self._next = path, specs, 0
        self._digest = hashlib.sha256()
        self._file = open(path, "wb")
        self._bytes = 0
        self._write(struct.pack("<Q", len(head)))
        self._write(head)

    def _write(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)
        self._bytes += len(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._specs[self._next]
        if (name, t.dtype, tuple(t.shape)) != (want, dtype, tuple(shape)) or t.device.type != "cpu":
            raise ValueError(f"{self.path}: expected {want} {dtype} {tuple(shape)} next, got {name} {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        if not t.is_contiguous():
            t = t.contiguous()
        self._write(_raw(t))
        self._next += 1

    def close(self) -> dict:
        if self._next != len(self._specs):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} declared tensor(s) never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"bytes": self._bytes, "sha256": self._digest.hexdigest()}

    def abort(self) -> None:
        self._file.close()


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> dict:
    """Write (name, tensor) pairs, in order, as one fsynced safetensors file; returns {"bytes", "sha256"}."""
    tensors = list(tensors)
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata)
    try:
        for name, t in tensors:
            writer.write(name, t)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


class SafetensorsFile:
    """A safetensors file opened for verified reading. The header is parsed and checked on open (and the
    size against `record`, the manifest's {"bytes", "sha256"}); `read(targets)` reads the data once, in file
    order, into the given tensors, hashing every byte, and fails unless the sha256 matches the record."""

    def __init__(self, path: Path, record: dict | None = None, fix: str = ""):
        self.path, self.record, self.fix = path, record, fix
        if not path.is_file():
            self.fail("missing: the manifest lists it but it is not there")
        size = path.stat().st_size
        if record is not None and size != record["bytes"]:
            what = "truncated" if size < record["bytes"] else "longer than written"
            self.fail(f"{what}: {size:,} bytes, the manifest says {record['bytes']:,}")
        self._file = open(path, "rb")
        self._digest = hashlib.sha256()
        try:
            raw = self._read_exact(8, "header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                self.fail(f"corrupt header: it claims {n:,} bytes of a {size:,}-byte file")
            head = self._read_exact(n, "header")
            try:
                header = json.loads(head.decode("utf-8"))
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                self.fail(f"corrupt header: not valid JSON ({type(e).__name__})")
            self.metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
            self.entries = self._check_entries(header, size - 8 - n)
        except BaseException:
            self._file.close()
            raise

    def close(self) -> None:
        self._file.close()

    def fail(self, problem: str):
        raise CheckpointError(f"{self.path}: {problem}{'; ' + self.fix if self.fix else ''}")

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            self.fail(f"truncated in its {what}")
        self._digest.update(data)
        return data

    def _check_entries(self, header, data_bytes: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        if not isinstance(header, dict):
            self.fail("corrupt header: not a JSON object of tensors")
        entries = {}
        for name, e in header.items():
            ok = (isinstance(e, dict) and e.get("dtype") in TORCH_DTYPES and isinstance(e.get("shape"), list)
                  and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                  and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                  and all(isinstance(o, int) for o in e["data_offsets"]))
            if not ok:
                dt = e.get("dtype") if isinstance(e, dict) else None
                self.fail(f"tensor {name!r} has dtype {dt}, which megatrain does not read (it reads "
                          f"{', '.join(TORCH_DTYPES)})" if isinstance(dt, str) and dt not in TORCH_DTYPES
                          else f"corrupt header: bad entry for tensor {name!r}")
            dtype, (a, b) = TORCH_DTYPES[e["dtype"]], e["data_offsets"]
            if b - a != math.prod(e["shape"]) * dtype.itemsize:
                self.fail(f"corrupt header: tensor {name!r} spans {b - a} bytes, its shape needs "
                          f"{math.prod(e['shape']) * dtype.itemsize}")
            entries[name] = (dtype, tuple(e["shape"]), a, b)
        end = 0
        for name, (_, _, a, b) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            if a != end:
                self.fail(f"corrupt header: tensor {name!r} starts at byte {a}, expected {end}")
            end = b
        if end != data_bytes:
            self.fail(f"corrupt: the header describes {end:,} bytes of tensors, the file holds {data_bytes:,}")
        return entries

    def read(self, targets: dict[str, torch.Tensor], cast: bool = False) -> None:
        """Read every tensor (those in `targets` into their memory, the rest only hashed) and verify. With
        `cast`, a target of another dtype than the file's is filled through one scratch buffer of the largest
        such tensor (bf16 weights into fp32 masters: no second copy of the model)."""
        scratch = None
        try:
            for name, (dtype, shape, a, b) in sorted(self.entries.items(), key=lambda kv: kv[1][2]):
                t = targets.get(name)
                if t is None:
                    self._skip(b - a)
                    continue
                if tuple(t.shape) != shape or not t.is_contiguous() or (t.dtype != dtype and not cast):
                    self.fail(f"tensor {name} is {dtype} {shape}, expected {t.dtype} {tuple(t.shape)}")
                dst = t
                if t.dtype != dtype:
                    if scratch is None or scratch.numel() < b - a:
                        scratch = torch.empty(max((y - x for dt, _, x, y in self.entries.values() if dt == dtype),
                                                  default=b - a), dtype=torch.uint8)
                    dst = scratch[: b - a].view(dtype).view(shape)
                view, pos = _raw(dst), 0
                while pos < len(view):
                    got = self._file.readinto(view[pos:])
                    if not got:
                        self.fail(f"truncated inside tensor {name}")
                    pos += got
                if self.record is not None:
                    self._digest.update(view)
                if dst is not t:
                    t.copy_(dst)
            if self._file.read(1):
                self.fail("longer than its header says")
        finally:
            self._file.close()
        if self.record is not None and self._digest.hexdigest() != self.record["sha256"]:
            self.fail(f"contents do not match the sha256 in the manifest (a flipped or rewritten byte): "
                      f"expected {self.record['sha256'][:16]}..., got {self._digest.hexdigest()[:16]}...")

    def _skip(self, n: int) -> None:
        if self.record is None:  # nothing to hash: seek past it
            self._file.seek(n, os.SEEK_CUR)
            return
        while n:
            data = self._file.read(min(n, _CHUNK))
            if not data:
                self.fail("truncated")
            self._digest.update(data)
            n -= len(data)


def copy_file(src: Path, dst: Path) -> dict:
    """Copy `src` to `dst`, fsynced, hashing on the way; returns its record {"bytes", "sha256"}."""
    digest, n = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)
            digest.update(chunk)
            n += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return {"bytes": n, "sha256": digest.hexdigest()}
