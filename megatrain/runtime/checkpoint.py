"""Checkpoints: a run's whole state as a folder of safetensors files and a JSON manifest.

Where it sits: the Trainer (trainer.py) saves one between steps (`megatrain train --checkpoint-every N`) and
loads one to resume (`--resume DIR`); `megatrain export` (export.py) reads the master weights back.
Format and guarantees: docs/CHECKPOINTS.md. Run its tests: `.venv/bin/pytest tests/runtime/test_checkpoint.py`.

`ROOT/step-00000120/` holds
- `<unit>.safetensors` per unit (`embed.safetensors`, `blocks.0.safetensors`, ..., `head.safetensors`):
  `master/<param>` (fp32), `exp_avg/<param>`, `exp_avg_sq/<param>` (the parameter's shape, in the host
  policy's stored dtype: F32, BF16 or F8_E4M3, with fp8's per-block scales `exp_avg_scale/<param>`,
  `exp_avg_sq_scale/<param>`, F32) and `step/<param>` (AdamW's step count, a fp32 scalar) for every parameter
  the unit owns, and `buffer/<buffer>` (fp32) for every buffer of the unit (MoE routing state)
  (HostStore.state_tensors);
- `state.safetensors`: RNG states as uint8 tensors (`rng/torch_cpu`, and `rng/cuda` on a GPU);
- `manifest.json`: format, step, model config, train spec, host policy, data position, plan hash, the unit
  layout, every file's size and sha256, and the sha256 of the manifest itself.

A save writes into a hidden `.step-….tmp-<pid>` folder, fsyncs every file (the manifest last) and the folder,
then renames it to its final name and fsyncs ROOT: a checkpoint exists whole or not at all. Tensor bytes go
from the store's memory to the file and the hash with no copy, unit by unit; a load reads each file straight
into the store's tensors while hashing it. Nothing is unpickled: safetensors is a JSON header and raw
little-endian bytes, written and parsed by its spec (tensorfiles.py; safetensors.safe_open reads them too).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import ValidationError
from pydantic_core import to_jsonable_python

from megatrain.files import fsync_dir, pid_alive, read_json, remove_tree

from .manifest_model import MAX_STEP, Manifest  # noqa: F401  (part of this module's API)
from .tensorfiles import (  # noqa: F401  (CheckpointError and the readers are part of this module's API)
    CheckpointError,
    SafetensorsFile,
    _raw,
    copy_file,
    write_safetensors,
)

MANIFEST = "manifest.json"
STATE_FILE = "state.safetensors"
FORMAT = "megatrain-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
OLD = ".old-"  # a checkpoint set aside while a rerun replaces it: .step-N.old-PID


# -- manifests ---------------------------------------------------------------------------------------------------
def _manifest_digest(body: dict) -> str:
    body = {k: v for k, v in body.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"  # a file of the checkpoint itself: no folder, no "..", nothing hidden


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint folder `ckpt`, checked against its own sha256 and validated (Manifest): its
    step must be the folder's, its version one this megatrain reads, every file a plain name in the folder."""
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        fix = (_earlier(Path(ckpt)) if _STEP_DIR.fullmatch(Path(ckpt).name) else
               "pass a checkpoint folder (step-NNNNNNNN) or the folder holding them")
        raise CheckpointError(f"{path}: missing, so {ckpt} is not a complete checkpoint (a save that was "
                              f"interrupted leaves none under its final name); {fix}")
    try:
        manifest = read_json(path, 64 << 20, "a checkpoint manifest", CheckpointError, "the manifest is corrupt")
    except CheckpointError as e:  # the earlier checkpoint is looked up only when it is needed
        raise CheckpointError(f"{e}; {_earlier(Path(ckpt))}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a megatrain checkpoint manifest (no \"format\": \"{FORMAT}\")")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {json.dumps(manifest.get('version'))[:20]}; this megatrain reads "
                              f"version {VERSION} only: a newer megatrain wrote it, or the manifest was edited")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: contents do not match the manifest's own sha256 (a flipped or edited "
                              f"byte): the manifest is corrupt; {_earlier(Path(ckpt))}")
    try:
        Manifest.model_validate(manifest)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        msg = (f"expected an object, got {json.dumps(err.get('input'))[:40]}" if err["type"] == "model_type"
               else err["msg"])
        raise CheckpointError(f"{path}: {where}: {msg}; the manifest is not one megatrain wrote; "
                              f"{_earlier(Path(ckpt))}") from None
    m = _STEP_DIR.fullmatch(Path(ckpt).name)
    if m and int(m.group(1)) != manifest["step"]:
        raise CheckpointError(f"{path}: says step {manifest['step']} but its folder is {Path(ckpt).name}; the "
                              f"folder was renamed or the manifest edited; {_earlier(Path(ckpt))}")
    return manifest


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `root` as (step, folder), oldest first: step-NNNNNNNN folders holding a
    manifest (a save writes it last, then renames the folder in). A folder of that name without one (an
    interrupted copy, say) is not a checkpoint: never resumed from, never counted or pruned."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir() and (p / MANIFEST).is_file()]
    return sorted(found)


def check_fresh_folder(root: Path, resumed_from: Path | None) -> None:
    """A run writes (and prunes) checkpoints in `root`: refused where `root` holds another run's, i.e. any
    checkpoint when the run starts fresh, or when it resumes from a checkpoint outside `root`."""
    found = step_dirs(root)
    # NOTE: the folder holding the resumed step, not the target of a step that is a link (linked in by hand)
    holder = Path(os.path.abspath(resumed_from)).parent.resolve() if resumed_from is not None else None
    if not found or holder == root.resolve():
        return
    latest = found[-1][1]
    started = "resumes from " + str(resumed_from) if resumed_from is not None else "starts from scratch"
    raise CheckpointError(f"{root} already holds checkpoints of another run (latest {latest.name}) and this run "
                          f"{started}: its checkpoints would replace and prune them. Continue that run with "
                          f"--resume {root}, or pass a new --checkpoint-dir")


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the latest checkpoint inside a folder of them."""
    path = Path(path)
    if (path / MANIFEST).is_file() or _STEP_DIR.fullmatch(path.name):
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'is a file, not a' if path.exists() else 'no such'} checkpoint folder; pass "
                              "the --checkpoint-dir of an earlier run or one of its step-NNNNNNNN folders")
    found = step_dirs(path)
    if not found:
        raise CheckpointError(f"{path}: holds no checkpoint (no step-NNNNNNNN folder); train with "
                              "--checkpoint-dir DIR --checkpoint-every N first")
    return found[-1][1]


def _earlier(ckpt: Path) -> str:
    """The fix for a bad checkpoint: the one before it, if any."""
    m = _STEP_DIR.fullmatch(ckpt.name)
    before = [p for s, p in step_dirs(ckpt.parent) if m and s < int(m.group(1))]
    return (f"use the previous checkpoint, {before[-1]} (--resume or --checkpoint {before[-1]})" if before
            else "no earlier checkpoint is there to use instead (a run starts again without --resume)")


# -- checks against this run ------------------------------------------------------------------------------------
def check_model(manifest: dict, config, ckpt: Path) -> None:
    """The checkpoint must hold the model this run trains (its name may differ: a label)."""
    mine = config.model_dump()
    theirs = manifest["model"] if isinstance(manifest["model"], dict) else {}
    diffs = [f"{k} {theirs.get(k)!r} vs {v!r}" for k, v in mine.items() if k != "name" and theirs.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"{ckpt / MANIFEST}: the checkpoint is of another model, {theirs.get('name', '?')!r} "
            f"({'; '.join(diffs[:4])}{' ...' if len(diffs) > 4 else ''}: checkpoint vs this run); resume with "
            f"the checkpoint's --model, or start a new --checkpoint-dir")


def check_train(manifest: dict, train, ckpt: Path) -> None:
    """Exact resume needs the same micro-batching, precision, optimizer and LR schedule."""
    theirs = manifest["train"] if isinstance(manifest["train"], dict) else {}
    mine = train.model_dump(mode="json")
    # a field the checkpoint predates had its default then (a newer megatrain added it)
    defaults = {k: to_jsonable_python(f.default) for k, f in type(train).model_fields.items() if not f.is_required()}
    theirs = {k: theirs.get(k, defaults.get(k)) for k in mine}
    flag = {"total_steps": "--steps", "warmup_steps": "--warmup"}  # the others: --field-name
    diffs = [f"{flag.get(k, '--' + k.replace('_', '-'))} {theirs[k]!r} vs {v!r}" for k, v in mine.items()
             if theirs[k] != v]
    if diffs:
        raise CheckpointError(
            f"{ckpt / MANIFEST}: the checkpoint was trained with other settings ({'; '.join(diffs)}: checkpoint "
            "vs this run); resume with the same --steps, --lr, --warmup, --seed, --seq-len, --micro-batch, "
            "--grad-accum, --dtype and --clip-norm, or the run would not continue exactly")


def _layout(store) -> list[dict]:
    return [_unit_layout(name, st) for name, st in store.units.items()]


def _unit_layout(name: str, st) -> dict:
    out = {"name": name, "file": f"{name}.safetensors",
           "params": [{"name": f"{name}.{p.name}", "shape": list(p.shape)} for p in st.owned]}
    if st.unit.buffers:
        out["buffers"] = [{"name": f"{name}.{b.name}", "shape": list(b.shape)} for b in st.unit.buffers]
    return out


# -- one run per folder --------------------------------------------------------------------------------------------
LOCK_FILE = ".megatrain.lock"


class FolderLock:
    """An advisory lock (fcntl.flock) on ROOT/.megatrain.lock, held while a run writes checkpoints into ROOT.

    A second run on the same folder is refused in one line naming the holder's pid. The kernel drops the lock
    when its holder dies however it dies, so a lock file a killed run left behind is simply taken over."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"{self.root}: another megatrain run (pid {holder}) is writing checkpoints here; "
                                  "wait for it, stop it, or pass another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


# -- save and load -----------------------------------------------------------------------------------------------
def read_extra(ckpt: Path, manifest: dict, name: str, cap: int = 256 * 2**20) -> bytes:
    """An extra file of a checkpoint (`hf/tokenizer.json`, ...), verified against the manifest."""
    record = manifest["files"].get(name)
    path = Path(ckpt) / name
    fix = _earlier(Path(ckpt))
    if not isinstance(record, dict) or not isinstance(record.get("bytes"), int) or record["bytes"] > cap:
        raise CheckpointError(f"{ckpt / MANIFEST}: lists no valid record for {name}; the manifest is incomplete; {fix}")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: the manifest lists it but it is not there; {fix}")
    data = path.read_bytes()
    if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise CheckpointError(f"{path}: contents do not match the sha256 in the manifest; {fix}")
    return data


def save_checkpoint(root: str | Path, step: int, store, meta: dict, rng: dict[str, torch.Tensor] | None = None,
                    keep: int | None = None, after_file: Callable[[str], None] | None = None,
                    extra: dict[str, Path] | None = None) -> Path:
    """Write `store` (between steps: the device synchronized) as ROOT/step-<step>; keep the last `keep`.

    `meta` (model, train, data, plan_sha256, ...) goes into the manifest; `extra` maps a relative name in the
    checkpoint (`hf/tokenizer.json`) to a small file copied in, listed and hashed like the rest;
    `after_file(name)` runs after each file is written (the trainer's test hook)."""
    root, final, tmp = begin_save(root, step)
    try:
        files = {}
        for unit in _layout(store):
            files[unit["file"]] = write_unit(tmp, unit["file"], store.state_tensors(unit["name"]), unit["name"])
            if after_file:
                after_file(unit["file"])
        finish_save(root, final, tmp, {"step": step, **meta, "host_policy": store.policy.name,
                                       "units": _layout(store)}, files, rng, extra, keep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def begin_save(root: str | Path, step: int, owner: int | None = None) -> tuple[Path, Path, Path]:
    """(ROOT, its step-<step> folder, the hidden temporary folder a save writes into, made empty); `owner` is
    the pid in the temporary's name (default: this process)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".{final.name}.tmp-{owner or os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return root, final, tmp


def write_unit(tmp: Path, name: str, state: dict[str, torch.Tensor], unit: str) -> dict:
    """One unit's state file (never a non-finite master), fsynced; returns its record."""
    _refuse_non_finite(state, unit)
    return write_safetensors(tmp / name, state.items())


def finish_save(root: Path, final: Path, tmp: Path, body: dict, files: dict, rng: dict | None,
                extra: dict[str, Path] | None, keep: int | None) -> None:
    """Write the RNG state, the extra files and the manifest (`body` + files, format, version, ...) into `tmp`,
    fsync, rename it to `final`, and keep the last `keep` checkpoints."""
    files[STATE_FILE] = write_safetensors(tmp / STATE_FILE, sorted((rng or {}).items()))
    for name, src in sorted((extra or {}).items()):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        files[name] = copy_file(src, tmp / name)
        fsync_dir((tmp / name).parent)
    from megatrain import __version__

    manifest = {"format": FORMAT, "version": VERSION, **body, "files": files, "megatrain_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    _write_json(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    old = None
    if final.exists():  # a rerun from an earlier checkpoint reaches this step again: replace it
        old = root / f".{final.name}{OLD}{os.getpid()}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:  # the earlier folder goes back (remove_stale does it after a kill here)
            os.replace(old, final)
        raise
    fsync_dir(root)
    if old is not None:
        remove_tree(old)
    if keep:  # the newest `keep` by step, never the folder just written (a rerun may find later ones)
        for _, path in [sp for sp in step_dirs(root)[:-keep] if sp[1] != final]:
            doomed = root / f".{path.name}.del-{os.getpid()}"
            os.replace(path, doomed)  # NOTE: rename first, so a half-deleted folder never looks like a checkpoint
            remove_tree(doomed)


def _refuse_non_finite(state: dict[str, torch.Tensor], unit: str) -> None:
    """The last guard: no checkpoint holds a non-finite master weight. A sum is one fast read and is finite
    only if every element is; only a sum that is not (or that overflowed) is checked element by element."""
    for name, t in state.items():
        if name.startswith("master/") and t.numel() and not math.isfinite(float(t.sum())) \
                and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{name}: not finite in unit {unit}; refusing to write a checkpoint that holds "
                                  "it: the earlier checkpoints are intact")


def remove_stale(root: Path) -> None:
    """Clear what interrupted saves and prunes of dead processes left behind (hidden .step-* folders): a
    checkpoint set aside to be replaced (`.step-N.old-PID`) whose replacement never arrived is renamed back,
    everything else is removed."""
    for path in root.glob(".step-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        if OLD in path.name:
            final = root / path.name[1:].split(OLD)[0]
            if not final.exists():
                os.replace(path, final)
                continue
        remove_tree(path)


def manifest_policy(manifest: dict, ckpt: Path | None = None) -> str:
    """The host policy a checkpoint's state was saved under (one from before host policies: exact); one this
    megatrain does not know (a newer one wrote it) is refused naming the checkpoint."""
    from megatrain.planner.host_policy import POLICIES

    policy = manifest.get("host_policy", "exact")
    if policy not in POLICIES:
        where = f"{ckpt / MANIFEST}: " if ckpt is not None else ""
        raise CheckpointError(f"{where}the checkpoint holds its AdamW state under host policy {policy!r}, which "
                              f"this megatrain does not know (it knows {', '.join(POLICIES)}); a newer megatrain "
                              "wrote it: resume with that version")
    return policy


def check_policy(manifest: dict, policy: str, ckpt: Path) -> None:
    """The moments are stored in the policy's dtype: a resume must hold them the same way."""
    theirs = manifest_policy(manifest, ckpt)
    if theirs != policy:
        raise CheckpointError(f"{ckpt / MANIFEST}: the checkpoint holds its AdamW state under host policy "
                              f"{theirs!r}, this run under {policy!r}; resume with --host-policy {theirs} (or auto), "
                              "or start a new --checkpoint-dir")


def check_layout(manifest: dict, store, ckpt: Path) -> None:
    if manifest["units"] != _layout(store):
        raise CheckpointError(f"{ckpt / MANIFEST}: its units and parameters do not match this model's layout; "
                              "the checkpoint is of another model or another megatrain version")


def load_checkpoint(ckpt: Path, manifest: dict, store) -> dict[str, torch.Tensor]:
    """Read every unit file of `ckpt` into `store` (verified); returns the RNG states (no copy to refresh: a
    load reads the masters). Check the model (check_model) before allocating the store, then call this."""
    check_policy(manifest, store.policy.name, ckpt)
    check_layout(manifest, store, ckpt)
    fix = _earlier(ckpt)
    files = manifest["files"]
    for unit in manifest["units"]:
        targets = store.state_tensors(unit["name"])
        _read_checked(ckpt, unit["file"], files, targets, fix)
    return _read_state(ckpt, files, fix)


def open_streamed(ckpt: Path, manifest: dict, store) -> tuple[str, dict[str, torch.Tensor]]:
    """Before a resume's first step reads the unit files while it trains (checkpoint_stream.py `load_state`):
    what `load_checkpoint` checks besides the files' contents, so only a flipped byte or an I/O error is left
    for the step to find: the policy and layout, every unit file listed, there at its size, its header sound
    and holding the unit's tensors. Returns (the errors' fix, the RNG states)."""
    check_policy(manifest, store.policy.name, ckpt)
    check_layout(manifest, store, ckpt)
    fix = _earlier(ckpt)
    files = manifest["files"]
    for unit in manifest["units"]:
        want = store.state_views(unit["name"])  # names only: nothing is read or written yet
        _open_checked(ckpt, unit["file"], files, want, fix).close()
    return fix, _read_state(ckpt, files, fix)


def read_unit(ckpt: Path, name: str, files: dict, targets: dict[str, torch.Tensor], fix: str) -> None:
    """One unit file `name` into the store's views `targets` (HostStore.state_tensors), its sha256 checked as it
    is read; an I/O error becomes the file's one-line CheckpointError."""
    try:
        _read_checked(ckpt, name, files, targets, fix)
    except OSError as e:
        raise CheckpointError(f"{ckpt / name}: cannot be read: {e.strerror or e}; {fix}") from None


def _open_checked(ckpt: Path, name: str, files: dict, targets: dict[str, torch.Tensor], fix: str,
                  exact: bool = True) -> SafetensorsFile:
    if name not in files:
        raise CheckpointError(f"{ckpt / MANIFEST}: lists no size and sha256 for {name}; the manifest is "
                              f"incomplete; {fix}")
    sf = SafetensorsFile(ckpt / name, files[name], fix)
    missing = sorted(set(targets) - set(sf.entries))
    extra = sorted(set(sf.entries) - set(targets)) if exact else []
    if missing or extra:
        sf.close()
        sf.fail(f"holds other tensors than expected ({'missing ' + missing[0] if missing else 'extra ' + extra[0]}"
                f"{' ...' if len(missing) + len(extra) > 1 else ''})")
    return sf


def _read_checked(ckpt: Path, name: str, files: dict, targets: dict[str, torch.Tensor], fix: str,
                  exact: bool = True) -> None:
    _open_checked(ckpt, name, files, targets, fix, exact).read(targets)


def _read_state(ckpt: Path, files: dict, fix: str) -> dict[str, torch.Tensor]:
    if STATE_FILE not in files:
        raise CheckpointError(f"{ckpt / MANIFEST}: lists no {STATE_FILE}; the manifest is incomplete; {fix}")
    sf = SafetensorsFile(ckpt / STATE_FILE, files[STATE_FILE], fix)
    out = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape, _, _) in sf.entries.items()}
    sf.read(out)
    return out


def read_unit_file(ckpt: Path, manifest: dict, unit: dict, buffers: bool = False) -> dict[str, torch.Tensor]:
    """One unit's fp32 master weights by parameter name, then (with `buffers`) its buffers by name, verified,
    from the unit's whole file (sharded_checkpoint.read_masters reads any checkpoint's, shards included)."""
    entries = [("master", p) for p in unit["params"]] + [("buffer", b) for b in unit.get("buffers", ()) if buffers]
    targets = {f"{kind}/{e['name']}": torch.empty(e["shape"], dtype=torch.float32) for kind, e in entries}
    _read_checked(ckpt, unit["file"], manifest["files"], targets, _earlier(ckpt), exact=False)
    return {name.split("/", 1)[1]: t for name, t in targets.items()}
