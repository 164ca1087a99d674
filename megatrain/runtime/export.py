"""Export: a checkpoint's master weights as a Hugging Face model folder, or as one safetensors file.

Where it sits: after training. `megatrain export --checkpoint DIR --out OUTDIR` writes what
`transformers.AutoModelForCausalLM.from_pretrained(OUTDIR)` loads: config.json (models/hf.py `hf_config`: the
imported folder's own config with every math field set from the trained model, or a complete one for the
model's family), generation_config.json, the weights in safetensors shards (`model.safetensors`, or
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` past `max_shard_bytes`), and the
tokenizer files of the folder the run started from (each checkpoint carries them under hf/). `--out
FILE.safetensors` writes the weights alone, as before; `--names megatrain` keeps this project's names there
(the only way out for models with no Hugging Face equivalent: depth mixing, MoE, qk_norm with qkv_bias,
which the Hugging Face names refuse in one line). Peak memory is one unit's weights.
Run its tests: `.venv/bin/pytest tests/runtime/test_hf.py tests/runtime/test_checkpoint.py -k export`.

Both outputs are written under a temporary name beside the target and renamed into place, so a failure
leaves the previous export as it was. An exported folder carries a marker: its weight files' safetensors
metadata names megatrain and the folder written (MARKER_KEY), so no file is added beside what transformers
reads, and a copy elsewhere is not taken for the export. A folder target that exists is replaced only when
it carries the marker for its own path and holds nothing but an export's files, or is empty. Anything
else (another model, a copy of one, any non-empty folder) needs `overwrite`, and a Hugging Face cache
snapshot (a path under `models--*/snapshots/`, or links into the cache's blobs) is refused even then: its
links would become real files holding the fine-tuned weights, served as the original revision. The folder
never lies inside the checkpoint it is made from, nor is it the current folder or one above it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from megatrain.files import fsync_dir
from megatrain.models import ModelConfig
from megatrain.models.hf import family_for, hf_config, hf_name

from .checkpoint import find_checkpoint, read_extra, read_manifest
from .hf_load import INDEX, NAMED_TEMPLATE, SOURCE_FILES
from .sharded_checkpoint import read_masters
from .tensorfiles import CheckpointError, SafetensorsWriter
from .tokenizer import CHAT_TEMPLATE_DIR

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"
MARKER_KEY = "megatrain_export"  # in the weights' metadata: the one kind of folder an export replaces unasked


def export_weights(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", names: str = "hf") -> dict:
    """Write the master weights of `checkpoint` (a folder, or the latest in a folder of them) to the single
    safetensors file `out`, atomically; returns a summary {checkpoint, step, tensors, params, bytes}."""
    if names not in ("hf", "megatrain"):
        raise ValueError(f"names {names!r}: use hf or megatrain")
    ckpt, manifest, config = _open(checkpoint, dtype)
    if names == "hf":
        family_for(config)  # refuses a model no Hugging Face family computes
    rename = hf_name if names == "hf" else (lambda n: n)
    specs = _specs(manifest, rename, DTYPES[dtype], buffers=names == "megatrain")
    out = Path(out)
    _refuse_inside(out, ckpt, manifest)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        (record,) = _pruned_aware(ckpt, lambda: _write_shards([tmp], [len(specs)], specs, manifest, ckpt, rename,
                                                            buffers=names == "megatrain"))
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        raise ValueError(f"cannot write --out {out}: {e.strerror or e}; the previous file, if any, is unchanged"
                         ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(specs),
            "params": sum(math.prod(s) for _, _, s in specs), "bytes": record["bytes"]}


def export_model_dir(checkpoint: str | Path, out: str | Path, dtype: str = "fp32",
                     max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False) -> dict:
    """Write `checkpoint` as a Hugging Face model folder `out`; returns {checkpoint, step, tensors, params,
    bytes, shards, architecture, files}. An existing folder that megatrain did not export is replaced only
    with `overwrite` (see the module docstring)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    ckpt, manifest, config = _open(checkpoint, dtype)
    files = manifest["files"] if isinstance(manifest.get("files"), dict) else {}
    base = json.loads(read_extra(ckpt, manifest, "hf/config.json")) if "hf/config.json" in files else None
    cfg = hf_config(config, str(DTYPES[dtype]).removeprefix("torch."), base)
    out = _named(Path(out))
    _refuse_inside(out, ckpt, manifest)
    _check_replaceable(out, overwrite)
    specs = _specs(manifest, hf_name, DTYPES[dtype], buffers=False)
    shards = _shard(specs, max_shard_bytes)
    n = len(shards)
    shard_names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        mark = {"format": "pt", MARKER_KEY: str(out.resolve())}
        records = _pruned_aware(ckpt, lambda: _write_shards([tmp / s for s in shard_names], shards, specs, manifest,
                                                            ckpt, hf_name, metadata=mark))
        written = ["config.json", *shard_names]
        _write_json(tmp / "config.json", cfg)
        if n > 1:
            wmap, k = {}, 0
            for shard, count in zip(shard_names, shards):
                wmap.update({name: shard for name, _, _ in specs[k:k + count]})
                k += count
            total = sum(math.prod(s) * dt.itemsize for _, dt, s in specs)
            _write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": wmap})
            written.append(INDEX)
        copied = [name for name in SOURCE_FILES if name != "config.json" and f"hf/{name}" in files]
        for name in copied:
            _write_bytes(tmp / name, read_extra(ckpt, manifest, f"hf/{name}"))
        if "generation_config.json" not in copied:
            _write_json(tmp / "generation_config.json", {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id",
                                                                                   "pad_token_id") if cfg.get(k) is not None})
        written += copied + (["generation_config.json"] if "generation_config.json" not in copied else [])
        prefix, suffix = NAMED_TEMPLATE.split("{}")
        named = sorted(n for n in files if n.startswith(prefix) and n.endswith(suffix))
        if named:  # the named chat templates, back in their folder beside chat_template.jinja
            (tmp / CHAT_TEMPLATE_DIR).mkdir()
            for n in named:
                name = f"{CHAT_TEMPLATE_DIR}/{n.removeprefix(prefix).removesuffix(suffix)}.jinja"
                _write_bytes(tmp / name, read_extra(ckpt, manifest, n))
                written.append(name)
        fsync_dir(tmp)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise ValueError(f"cannot write --out {out}: {e.strerror or e}; the previous export, if any, is unchanged"
                         ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(specs),
            "params": sum(math.prod(s) for _, _, s in specs), "bytes": sum(r["bytes"] for r in records),
            "shards": n, "architecture": cfg["architectures"][0], "files": sorted(written)}


# -- helpers ---------------------------------------------------------------------------------------------------
def _open(checkpoint, dtype: str) -> tuple[Path, dict, ModelConfig]:
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    ckpt = find_checkpoint(checkpoint)
    manifest = read_manifest(ckpt)
    try:
        config = ModelConfig.model_validate(manifest["model"])
    except ValueError:
        raise ValueError(f"{ckpt}/manifest.json: its model is not a valid config for this megatrain") from None
    return ckpt, manifest, config


def _specs(manifest: dict, rename, dtype: torch.dtype, buffers: bool) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every exported tensor in unit order; with `buffers`, each unit's buffers after
    its parameters, under their own names and in fp32 (thresholds are compared with fp32 router logits)."""
    out = []
    for u in manifest["units"]:
        out += [(rename(p["name"]), dtype, tuple(p["shape"])) for p in u["params"]]
        if buffers:
            out += [(b["name"], torch.float32, tuple(b["shape"])) for b in u.get("buffers", ())]
    return out


def _shard(specs: list, max_bytes: int) -> list[int]:
    """Tensors per shard, in order, each shard at most `max_bytes` unless one tensor alone is larger."""
    counts, size = [0], 0
    for _, dt, shape in specs:
        n = math.prod(shape) * dt.itemsize
        if counts[-1] and size + n > max_bytes:
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += n
    return counts


def _write_shards(paths: list[Path], counts: list[int], specs: list, manifest: dict, ckpt: Path,
                  rename, buffers: bool = False, metadata: dict | None = None) -> list[dict]:
    """Stream every unit's verified masters (and, with `buffers`, its buffers) into consecutive shards of
    `counts` tensors each, in the order of `specs`; returns each shard's {"bytes", "sha256"}."""
    firsts, k = {}, 0
    for shard, c in enumerate(counts):
        firsts[k] = shard
        k += c
    records, writer, i = [], None, 0
    try:
        for unit in manifest["units"]:  # one unit's weights in memory at a time
            kept = {b["name"] for b in unit.get("buffers", ())}
            for name, t in read_masters(ckpt, manifest, unit, buffers=buffers).items():
                if i in firsts:
                    if writer is not None:
                        records.append(writer.close())
                    shard = firsts[i]
                    writer = SafetensorsWriter(paths[shard], specs[i:i + counts[shard]], metadata or {"format": "pt"})
                writer.write(name if name in kept else rename(name), t.to(specs[i][1]))
                i += 1
        records.append(writer.close())
        writer = None
    finally:
        if writer is not None:
            writer.abort()
    return records


def _pruned_aware(ckpt: Path, read):
    """`read()`; a checkpoint folder that vanished while it was read was pruned by the run still writing
    beside it (--keep-checkpoints), which is no corruption: say so, and name the newest one."""
    try:
        return read()
    except CheckpointError:
        if ckpt.is_dir():
            raise
        try:
            latest = f"the newest now is {find_checkpoint(ckpt.parent)}"
        except CheckpointError:
            latest = "none is left there"
        raise CheckpointError(f"{ckpt}: removed while it was exported (the run writing beside it pruned it, "
                              f"--keep-checkpoints); export again: {latest}") from None


def _refuse_inside(out: Path, ckpt: Path, manifest: dict) -> None:
    """--out must not touch the checkpoint it exports, nor the Hugging Face folder its run started from (the
    base model: a save_pretrained folder holds exactly what an export writes, so nothing else would stop it)."""
    o, c = out.resolve(), ckpt.resolve()
    if o == c or c in o.parents or o in c.parents:
        raise ValueError(f"--out {out} lies inside (or holds) the checkpoint {ckpt} it exports; writing there could "
                         "destroy the checkpoint: choose a path outside it")
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    base = source.get("hf_dir")
    if isinstance(base, str) and base:
        b = Path(base).resolve()
        if o == b or b in o.parents or o in b.parents:
            raise ValueError(f"--out {out} is (or holds, or lies inside) {base}, the Hugging Face model this run "
                             "was trained from; an export there would replace the base model: choose a new folder")


def _named(out: Path) -> Path:
    """`out` with a name of its own (`.`, `..` and `/` resolved), so its temporary siblings can be named."""
    return out if out.name not in ("", ".", "..") else out.resolve()


def hf_cache_folder(out: Path) -> bool:
    """Whether `out` is (or lies in) a Hugging Face cache snapshot, or holds links into a cache's blobs."""
    for path in (out.absolute(), out.resolve()):
        parts = path.parts
        if any(a.startswith("models--") and b == "snapshots" for a, b in zip(parts, parts[1:])):
            return True
    if out.is_dir():
        for p in out.iterdir():
            if p.is_symlink() and "blobs" in Path(os.readlink(p)).parts:
                return True
    return False


def _check_replaceable(out: Path, overwrite: bool = False) -> None:
    """A folder target is replaced only when megatrain exported it (its marker, and nothing but an export's
    files) or it is empty; any other one only with `overwrite`; a Hugging Face cache snapshot never."""
    if hf_cache_folder(out):
        raise ValueError(f"--out {out} is a Hugging Face cache snapshot; an export would turn its links into files "
                         "holding the fine-tuned weights, served as the original model's revision: export to a "
                         "new folder (even --overwrite does not write there)")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for a Hugging Face model (or a .safetensors path)")
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ValueError(f"--out {out} is the current folder ({here}) or one above it, which an export would "
                         "replace whole; name a new folder, e.g. --out exported-model")
    entries = sorted(p.name for p in out.iterdir())
    if not entries or overwrite:
        return
    ours = set(SOURCE_FILES) | {INDEX, "model.safetensors", CHAT_TEMPLATE_DIR}
    foreign = [n for n in entries if n not in ours and not (n.startswith("model-") and n.endswith(".safetensors"))]
    if not foreign and not _exported_here(out):
        raise ValueError(f"--out {out} holds a model that megatrain did not export there (a download, or a copy): "
                         "an export replaces the folder whole; choose a new folder, or pass --overwrite to replace it")
    if foreign:
        raise ValueError(f"--out {out} holds {foreign[0]}, which an export does not write; choose an empty or new "
                         "folder, or pass --overwrite (an earlier export there is replaced whole)")


def _exported_here(out: Path) -> bool:
    """Whether the weights in `out` carry the marker of an export to this very folder."""
    weights = out / "model.safetensors"
    if not weights.is_file() and (out / INDEX).is_file():
        try:
            shards = sorted(set(json.loads((out / INDEX).read_bytes()[:1 << 26])["weight_map"].values()))
            weights = out / shards[0]
        except (ValueError, KeyError, TypeError, IndexError, OSError):
            return False
    try:
        with open(weights, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if n <= 1 << 26 else {}
    except (ValueError, OSError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get(MARKER_KEY) == str(out.resolve())


def _write_json(path: Path, data: dict) -> None:
    _write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
