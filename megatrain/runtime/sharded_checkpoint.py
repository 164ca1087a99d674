"""Sharded checkpoints: every rank writes its shards, rank 0 writes one manifest; resume at any world size.

Where it sits: the Trainer of a world (distributed.py) saves with `save` and resumes with `load`, which also
reshards (and loads a one-rank checkpoint into a world, or a world's into one rank); export reads a sharded
checkpoint's whole masters with `read_masters` (any checkpoint's: a one-rank one's through checkpoint.py). docs/CHECKPOINTS.md describes the
format. Run its tests: `.venv/bin/pytest tests/runtime/test_distributed.py -k checkpoint`.

`ROOT/step-00000120/` of an R-rank run holds, beside what a one-rank checkpoint holds (state.safetensors,
hf/..., manifest.json):
- `<unit>.rank00003.safetensors` for every sharded unit and rank: that rank's shard of the unit's padded flat
  state (sharded_store.py `shard_state`): `master` (fp32), `exp_avg`, `exp_avg_sq` (the policy's dtype), fp8's
  block scales, `step` (one count per slice) and the unit's routing buffers as `buffer`;
- `<unit>.safetensors` for every replicated unit (a tied parameter's holder and owner: every rank holds it
  whole), in the one-rank format, written by rank 0.
The manifest's `world` holds the run's nproc and nnodes and, per sharded unit, its padded size, its shard
size, its parameters' offsets and every rank's file; `units` is the model's layout as a one-rank checkpoint
lists it (the `file` of a sharded unit names rank 0's shard).

A save: rank 0 makes the hidden temporary folder and every rank writes and fsyncs its files there (a shared
filesystem: a rank that does not see rank 0's folder says so), then rank 0, after a barrier that gathers every
rank's file records, writes the manifest and renames the folder: whole or absent, as one rank's. A load at the
same world size reads each rank's own files: bit for bit. At another size, or from or to one rank, it
rebuilds each unit's state element range by element range from the files that cover it (the elements of a
flat buffer are the same at every size; only the padding and the cut points move) and takes the AdamW step
count of each of its slices from its parameter: weights, moments and counts are equal, so training continues
from equal state (to fp32 round-off of the new world's sums from then on). fp8 moments reshard only at the
same size: their block scales belong to the slices.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import checkpoint
from .checkpoint import MANIFEST, CheckpointError, SafetensorsFile

SHARD_FILE = "{unit}.rank{rank:05d}.safetensors"


def logical_units(ir) -> list[dict]:
    """The model's unit layout as a one-rank checkpoint's manifest lists it (file: the unit's own)."""
    out = []
    for u in ir.units:
        d = {"name": u.name, "file": f"{u.name}.safetensors",
             "params": [{"name": f"{u.name}.{p.name}", "shape": list(p.shape)} for p in u.params
                        if p.name not in u.tied]}
        if u.buffers:
            d["buffers"] = [{"name": f"{u.name}.{b.name}", "shape": list(b.shape)} for b in u.buffers]
        out.append(d)
    return out


def save(root, step: int, store, meta: dict, comm, rng: dict | None = None, keep: int | None = None,
         after_file=None, extra: dict[str, Path] | None = None) -> Path:
    """Write a ShardedHostStore (every rank calls it, between steps) as ROOT/step-<step>; returns the folder."""
    owner = comm.gather_objects(os.getpid(), what="the checkpoint's owner")[0]
    if comm.rank == 0:
        root, final, tmp = checkpoint.begin_save(root, step, owner)
    else:
        root = Path(root)
        final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp-{owner}"
    comm.barrier("the checkpoint folder's creation")
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp}: rank {comm.rank} does not see the folder rank 0 made: --checkpoint-dir must "
                              "be on a filesystem every node shares (NFS, Lustre, ...)")
    files, ir = {}, store.full_ir
    try:
        for u in ir.units:
            if u.name in store.sharded:
                name = SHARD_FILE.format(unit=u.name, rank=comm.rank)
                state = store.shard_state(u.name)
            elif comm.rank == 0:
                name, state = f"{u.name}.safetensors", store.state_tensors(u.name)
            else:
                continue
            files[name] = checkpoint.write_unit(tmp, name, state, u.name)
            if after_file:
                after_file(name)
        every = comm.gather_objects(files, what="the checkpoint's file records")
        if comm.rank == 0:
            for theirs in every:
                files.update(theirs)
            checkpoint.finish_save(root, final, tmp, manifest_body(step, meta, ir, store, comm), files, rng, extra,
                                   keep)
    except BaseException:
        if comm.rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        raise
    comm.barrier("the checkpoint's manifest")
    return final


def manifest_body(step: int, meta: dict, ir, store, comm) -> dict:
    """The manifest of a sharded checkpoint at `step` before its files' records (checkpoint.finish_save adds
    them): every logical unit, a sharded one named by its rank-0 shard file, and the world's layout. The
    synchronous save and the checkpointing step's seal (checkpoint_stream.py) both write this."""
    body = {"step": step, **meta, "host_policy": store.policy.name, "units": logical_units(ir),
            "world": world_entry(ir, store, comm)}
    for d in body["units"]:
        if d["name"] in store.sharded:
            d["file"] = SHARD_FILE.format(unit=d["name"], rank=0)
    return body


def world_entry(ir, store, comm) -> dict:
    return {"nproc": comm.size, "nnodes": comm.nnodes, "sharded": {
        u.name: {"numel": u.flat_numel, "shard": u.flat_numel // comm.size,
                 "params": [[p.name, p.offset, p.numel] for p in u.params],
                 "files": [SHARD_FILE.format(unit=u.name, rank=r) for r in range(comm.size)]}
        for u in ir.units if u.name in store.sharded}}


# -- reading ------------------------------------------------------------------------------------------------------
KINDS = ("master", "exp_avg", "exp_avg_sq")


def _pieces(params, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
    """(param, start in it, numel, offset in [lo, hi)) of every parameter's part inside [lo, hi)."""
    out = []
    for name, off, n in params:
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((name, a - off, b - a, a - lo))
    return out


class _Source:
    """One unit's saved state, read by element range of its flat buffer: from its shard files (`entry`, the
    manifest's world entry of the unit) or from its whole file (`entry` None: `params` are (name, offset,
    numel, shape) at the offsets of the flat buffer)."""

    def __init__(self, ckpt: Path, manifest: dict, name: str, entry: dict | None, params=(), buffers=()):
        self.ckpt, self.files, self.name, self.entry = Path(ckpt), manifest["files"], name, entry
        self.fix = checkpoint._earlier(self.ckpt)
        self.params = [tuple(p[:3]) for p in (entry["params"] if entry else params)]
        self.shapes = {p[0]: p[3] for p in params}
        self.buffers = list(buffers)  # (name, numel, shape)

    def read(self, file: str, targets: dict[str, torch.Tensor]) -> None:
        """Read `file` of the checkpoint (verified) into `targets`, which it must hold."""
        if file not in self.files:
            raise CheckpointError(f"{self.ckpt / MANIFEST}: lists no size and sha256 for {file}; the manifest is "
                                  f"incomplete; {self.fix}")
        sf = SafetensorsFile(self.ckpt / file, self.files[file], self.fix)
        missing = sorted(set(targets) - set(sf.entries))
        if missing:
            sf.close()
            sf.fail(f"lacks tensor {missing[0]}")
        sf.read(targets)

    def fill(self, lo: int, hi: int, out: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> dict[str, float]:
        """Write elements [lo, hi) of the unit's flat `kinds` (master, exp_avg, exp_avg_sq) into `out` (flat,
        hi - lo elements each, zero beyond what was saved), and its buffers into `out["buffer"]` if there;
        returns the AdamW step count of each parameter intersecting the range."""
        return self._fill_shards(lo, hi, out, kinds) if self.entry else self._fill_whole(lo, hi, out, kinds)

    def _fill_whole(self, lo, hi, out, kinds) -> dict[str, float]:
        u, targets, parts = self.name, {}, _pieces(self.params, lo, hi)
        for name, *_ in parts:
            for kind in kinds:
                targets[f"{kind}/{u}.{name}"] = torch.empty(self.shapes[name], dtype=out[kind].dtype)
            targets[f"step/{u}.{name}"] = torch.empty(())
        at = 0
        for b, numel, shape in self.buffers if "buffer" in out else ():
            targets[f"buffer/{u}.{b}"] = out["buffer"][at : at + numel].view(shape)
            at += numel
        self.read(f"{u}.safetensors", targets)
        for name, start, n, offset in parts:
            for kind in kinds:
                out[kind][offset : offset + n].copy_(targets[f"{kind}/{u}.{name}"].view(-1)[start : start + n])
        return {name: float(targets[f"step/{u}.{name}"]) for name, *_ in parts}

    def _fill_shards(self, lo, hi, out, kinds) -> dict[str, float]:
        S, files = self.entry["shard"], self.entry["files"]
        wanted = [q for q in range(len(files)) if max(lo, q * S) < min(hi, (q + 1) * S)]
        if "buffer" in out and not wanted:
            wanted = [0]
        steps: dict[str, float] = {}
        for k, q in enumerate(wanted):
            mine = _pieces(self.params, q * S, (q + 1) * S)
            targets = {kind: torch.empty(S, dtype=out[kind].dtype) for kind in kinds}
            targets["step"] = torch.empty(len(mine))
            if "buffer" in out and k == 0:
                targets["buffer"] = out["buffer"]
            self.read(files[q], targets)
            a, b = max(lo, q * S), min(hi, (q + 1) * S)
            for kind in kinds:
                if a < b:
                    out[kind][a - lo : b - lo].copy_(targets[kind][a - q * S : b - q * S])
            for j, (name, *_) in enumerate(mine):
                steps.setdefault(name, float(targets["step"][j]))
        return steps


def _source(ckpt: Path, manifest: dict, u) -> _Source:
    """The saved state of unit `u` (a UnitIR of this run: its offsets are every run's)."""
    entry = (manifest.get("world") or {}).get("sharded", {}).get(u.name)
    params = [(p.name, p.offset, p.numel, p.shape) for p in u.params if p.name not in u.tied]
    return _Source(ckpt, manifest, u.name, entry, params, [(b.name, b.numel, b.shape) for b in u.buffers])


def load(ckpt: Path, manifest: dict, store, comm=None) -> dict[str, torch.Tensor]:
    """Read checkpoint `ckpt` (sharded or not) into `store` (a ShardedHostStore, or a HostStore of one rank),
    verified; returns the RNG states. Same world size: each rank's own files, bit for bit; otherwise resharded
    unit by unit (see the module docstring)."""
    checkpoint.check_policy(manifest, store.policy.name, ckpt)
    ir = getattr(store, "full_ir", store.ir)
    if [_no_file(d) for d in manifest["units"]] != [_no_file(d) for d in logical_units(ir)]:
        raise CheckpointError(f"{ckpt / MANIFEST}: its units and parameters do not match this model's layout; the "
                              "checkpoint is of another model or another megatrain version")
    saved = (manifest.get("world") or {}).get("nproc", 1)
    size = comm.size if comm is not None else 1
    if store.policy.moments == "fp8" and saved != size:
        raise CheckpointError(f"{ckpt / MANIFEST}: fp8 moments saved by {saved} rank(s) cannot be resharded to "
                              f"{size} (their block scales belong to the slices); resume with torchrun "
                              f"--nproc-per-node {saved} (as many ranks as saved it)")
    sharded = getattr(store, "sharded", frozenset())
    for u in ir.units:
        src = _source(ckpt, manifest, u)
        if u.name in sharded and src.entry and saved == size and src.entry["shard"] * size == u.flat_numel:
            src.read(src.entry["files"][comm.rank], store.shard_state(u.name))  # bit for bit
        elif u.name in sharded:
            _reshard(src, store, u)
        elif src.entry is None:
            checkpoint._read_checked(ckpt, f"{u.name}.safetensors", manifest["files"],
                                     store.state_tensors(u.name), src.fix)
        else:
            _to_whole(src, store, u)
    return checkpoint._read_state(ckpt, manifest["files"], checkpoint._earlier(ckpt))


def _no_file(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "file"}


def _reshard(src: _Source, store, u) -> None:
    """Rebuild this rank's shard of `u` from a checkpoint of another layout."""
    state, st = store.shard_state(u.name), store.units[u.name]
    S = st.unit.flat_numel
    lo = store.rank * S
    out = {k: torch.zeros(S, dtype=state[k].dtype) for k in KINDS}
    if "buffer" in state:
        out["buffer"] = state["buffer"]
    steps = src.fill(lo, lo + S, out, KINDS)
    for k in KINDS:
        state[k].copy_(out[k])
    for j, p in enumerate(st.owned):
        state["step"][j] = steps[p.name]


def _to_whole(src: _Source, store, u) -> None:
    """Rebuild a whole unit of a one-rank store from a sharded checkpoint."""
    from .host_adamw import moment_dtype

    st, dtype = store.units[u.name], moment_dtype(store.policy)
    n = min(u.flat_numel, src.entry["numel"])
    out = {"master": torch.zeros(n), "exp_avg": torch.zeros(n, dtype=dtype), "exp_avg_sq": torch.zeros(n, dtype=dtype)}
    if st.unit.buffers:
        out["buffer"] = st.buffers
    steps = src.fill(0, n, out, KINDS)
    views = store.state_tensors(u.name)
    for p in st.owned:
        for k in KINDS:
            views[f"{k}/{u.name}.{p.name}"].view(-1).copy_(out[k][p.offset : p.offset + p.numel])
        views[f"step/{u.name}.{p.name}"].fill_(steps[p.name])


def read_masters(ckpt: Path, manifest: dict, unit: dict, buffers: bool = False) -> dict[str, torch.Tensor]:
    """One unit's fp32 master weights by parameter name, then (with `buffers`) its buffers by name, verified,
    from any checkpoint (export reads them unit by unit): a sharded unit's gathered from its shards, any other's
    from its whole file (checkpoint.read_unit_file)."""
    entry = manifest["world"]["sharded"].get(unit["name"]) if manifest.get("world") else None
    if entry is None:
        return checkpoint.read_unit_file(ckpt, manifest, unit, buffers)
    specs = [(b["name"].removeprefix(unit["name"] + "."), _numel(b["shape"]), tuple(b["shape"]))
             for b in unit.get("buffers", ())]
    src = _Source(ckpt, manifest, unit["name"], entry, buffers=specs)
    out = {"master": torch.zeros(entry["numel"])}
    if buffers and specs:
        out["buffer"] = torch.zeros(sum(n for _, n, _ in specs))
    src.fill(0, entry["numel"], out, ("master",))
    result = {spec["name"]: out["master"][off : off + numel].view(spec["shape"])
              for (_, off, numel), spec in zip(entry["params"], unit["params"])}
    at = 0
    for (name, numel, shape) in specs if "buffer" in out else ():
        result[f"{unit['name']}.{name}"] = out["buffer"][at : at + numel].view(shape)
        at += numel
    return result


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
