"""The checkpoint manifest's schema: every key a run writes, typed, so a malformed manifest is refused naming
the field (checkpoint.py `read_manifest` validates with `Manifest` after checking the manifest's own sha256).

Strict types (a string is not a number, null is not an object); the keys a training run writes beside the
required ones (data position, run, settings, source, sharded world, ...) are checked when present, since a
save of a bare store writes model, train, units and files alone. Format: docs/CHECKPOINTS.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"  # a file of the checkpoint itself: no folder, no "..", nothing hidden
MAX_STEP = 10**12


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    shape: list[Annotated[StrictInt, Field(ge=0)]]


class _Unit(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    file: Annotated[StrictStr, StringConstraints(pattern=rf"^{_NAME}\.safetensors$")]
    params: list[_Tensor]
    buffers: list[_Tensor] = []


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: StrictInt = Field(ge=0)
    sha256: Annotated[StrictStr, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


_Count = Annotated[StrictInt, Field(ge=0)]
_Positive = Annotated[StrictInt, Field(gt=0)]
_Sha256 = Annotated[StrictStr, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Fingerprint(BaseModel):
    model_config = ConfigDict(extra="allow")
    kind: StrictStr
    sha256: StrictStr


class _Data(BaseModel):
    """The data position (runtime/data.py Batcher.state, examples.py's adds its own keys)."""
    model_config = ConfigDict(extra="allow")
    seed: _Count
    step: Annotated[StrictInt, Field(ge=0, le=MAX_STEP)]
    micro_batch: _Positive
    seq_len: _Positive
    n_micro_batches: _Positive
    data: StrictStr
    n_tokens: _Count
    sha256: StrictStr | None = None
    fingerprint: _Fingerprint | None = None
    pack: StrictBool | None = None
    n_examples: _Count | None = None
    n_dropped: _Count | None = None


class _Run(BaseModel):
    model_config = ConfigDict(extra="allow")
    device: StrictStr
    gpu_budget_bytes: _Positive
    hardware: StrictStr
    on_nan: Literal["abort", "skip"]


class _Source(BaseModel):
    model_config = ConfigDict(extra="allow")
    hf_dir: StrictStr


class _Sharded(BaseModel):
    model_config = ConfigDict(extra="forbid")
    numel: _Count
    shard: _Count
    params: list[tuple[StrictStr, _Count, _Count]]
    files: list[Annotated[StrictStr, StringConstraints(pattern=rf"^{_NAME}$")]]


class _World(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nproc: _Positive
    nnodes: _Positive
    sharded: dict[StrictStr, _Sharded]


class Manifest(BaseModel):
    """What a checkpoint manifest holds, typed whole (strict: a string is not a number, null is no object): the
    keys a training run writes are checked when present (a save of a bare store writes model, train, units and
    files alone); keys of a later megatrain are kept as they are."""

    model_config = ConfigDict(extra="allow")
    format: Literal["megatrain-checkpoint"]
    version: Literal[1]
    step: StrictInt = Field(ge=0, le=MAX_STEP)
    model: dict
    train: dict
    units: list[_Unit]
    files: dict[Annotated[StrictStr, StringConstraints(pattern=rf"^(hf/)?{_NAME}$")], _File]
    manifest_sha256: StrictStr
    # NOTE: a default of None is never validated, so these may be absent, but null where given is refused
    data: _Data = None
    plan_sha256: _Sha256 = None
    run: _Run = None
    settings: dict[StrictStr, object] | None = None  # null from the Python API of older megatrains
    source: _Source | None = None
    host_policy: StrictStr = None
    world: _World = None
    megatrain_version: StrictStr = None
    created: StrictStr = None
