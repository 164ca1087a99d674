"""RunConfig: every setting of one training run, as one validated value.

Where it sits: what `Trainer` (trainer.py) takes. `megatrain train`'s flags, a TOML run file (runfile.py) and
the Python API all build one; `settings()` is its flat form, keyed by setting name (a train flag without its
dashes: `gpu-mem`, `lr`, `steps`), which a run prints at start, every checkpoint manifest stores, and a run
file holds: `RunConfig.from_settings(config.settings()) == config`.
Try it: `python -c "from megatrain.runtime.config import RunConfig as R; print(R.from_settings({'model': 'tiny',
'seq-len': 64, 'steps': 20, 'gpu-mem': '6MiB'}).settings())"`.

Every range is checked once, here or in TrainSpec (the optimizer step's own settings, held as `train`); an
error is one ValueError naming the field (`RunConfig(...)`) or the setting's flag (`from_settings`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from megatrain.models import ModelConfig
from megatrain.models.depth.spec import FORMS
from megatrain.planner.bytesize import parse_bytes
from megatrain.planner.hardware import Hardware
from megatrain.planner.train import MAX_STEPS, RECIPES, TrainSpec

# TrainSpec fields whose setting is named apart; the others are their own names
TRAIN_NAMES = {"total_steps": "steps", "warmup_steps": "warmup"}
SIZES = ("gpu_mem", "host_mem")  # byte sizes: "6MiB" or an integer of bytes
PATHS = ("data", "val_data", "metrics", "tensorboard", "trace", "plot", "checkpoint_dir", "resume")


class RunConfig(BaseModel):
    """Everything one training run needs: what to train, on what, from which data, and what to keep."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              arbitrary_types_allowed=True)

    model: str | ModelConfig = Field(description="a preset name (tiny, llama3-8b, ...), a .json/.toml model "
                                     "config, or a Hugging Face model folder (training starts from its weights)")
    depth_mixing: str | None = Field(None, description="override the model's depth mixing: " + FORMS)
    train: TrainSpec = Field(description="micro-batching, precision, AdamW and the learning-rate schedule; "
                             "total_steps is the run's length")
    gpu_mem: int = Field(description="the device memory budget in bytes (a size such as '6MiB' or '80GiB')")
    hardware: str | Hardware = Field("auto", description="a hardware preset, a profile JSON from `megatrain "
                                     "probe`, or auto: the profile of the device that runs it")
    host_mem: int | None = Field(None, gt=0, description="host memory available in bytes, overriding the "
                                 "hardware profile's")
    device: Literal["sim", "cuda", "auto"] = Field("auto", description="sim: CPU-backed simulated GPU; cuda: "
                                                   "the real one; auto: cuda if present")
    host_policy: str = Field("auto", description="how the host holds AdamW state: exact, bf16-moments, bf16, "
                             "fp8, or auto: the most exact that fits host memory")
    resident: str | dict[str, str] = Field(
        "auto", description="where each unit's weights, gradients and AdamW state live: auto lets the planner keep "
        "units on the device where the budget has room and that shortens the step (their optimizer step runs "
        "there); none streams every unit from the host; a table {unit = place} forces the named units' places")
    profile: Literal["auto", "off"] = Field("auto", description="auto: plan with this machine's cached probe of "
                                            "the model's units when one exists, the sizes those of the hardware "
                                            "given; off: the hardware profile as given. Default: auto with "
                                            "hardware auto, else off")
    data: str | None = Field(None, description="the training token or example file")
    val_data: str | None = Field(None, description="the validation token or example file")
    pack: bool | None = Field(None, description="instruction data: several examples per sequence (default) or, "
                              "false, one example per sequence, padded")
    log_every: int = Field(1, gt=0, le=MAX_STEPS, description="a metrics record every N steps")
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="validation loss every N steps (0: never)")
    metrics: str | None = Field(None, description="write one JSON record per logged step to this file (a new "
                                "run's own; a resumed run appends)")
    tensorboard: str | None = Field(None, description="also write the metrics records as TensorBoard scalars "
                                    "into this folder (needs the tensorboard extra)")
    trace: str | None = Field(None, description="write the measured timeline as a Chrome/Perfetto trace")
    plot: str | None = Field(None, description="draw the last step as measured beside the plan (.png or .svg)")
    no_progress: bool = Field(False, description="no progress bar")
    checkpoint_dir: str | None = Field(None, description="where checkpoints go, one step-NNNNNNNN folder each")
    checkpoint_every: int = Field(0, ge=0, le=MAX_STEPS, description="a checkpoint every N steps and after the "
                                  "last one (0: none)")
    keep_checkpoints: int | None = Field(3, gt=0, le=MAX_STEPS, description="keep the last K checkpoints "
                                         "(None: all)")
    resume: str | None = Field(None, description="continue from a checkpoint folder, or the latest one in a "
                               "checkpoint_dir")
    allow_data_change: bool = Field(False, description="resume although the data's bytes differ from the "
                                    "checkpoint's record of them")
    allow_schedule_change: bool = Field(False, description="resume although steps or lr differ from the "
                                        "checkpoint's: the run extended (or shortened), its peak learning rate "
                                        "changed, from the checkpoint's step on (`megatrain train --resume` allows "
                                        "it: a flag given on a resume is a change asked for)")
    on_nan: Literal["abort", "skip"] = Field("abort", description="a NaN/inf loss or gradient: abort (keep the "
                                             "last checkpoint) or skip (apply no update for that step, go on)")
    sim_threads: int | None = Field(None, gt=0, description="intra-op threads of the sim device's compute "
                                    "stream (default: torch's)")
    compile_units: bool = Field(False, description="run the unit templates through torch.compile (results "
                                "equal eager to fp32 round-off; dense models only)")
    loss_chunk: int = Field(1024, gt=0, description="tokens per chunk of the loss (the logits' working set)")
    nproc: int | None = Field(None, description="data-parallel ranks in all (torchrun starts them)")
    nnodes: int | None = Field(None, description="nodes the ranks run on")
    dist_timeout: float = Field(600.0, gt=0, description="under torchrun: seconds a collective may wait for "
                                "the other ranks")

    def __init__(self, /, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(e.errors(include_url=False)[0]) from None

    @model_validator(mode="before")
    @classmethod
    def _profile(cls, data):
        if isinstance(data, dict) and data.get("profile") is None:
            data = {**data, "profile": "auto" if data.get("hardware", "auto") == "auto" else "off"}
        return data

    @field_validator("model", "hardware", *PATHS, mode="before")
    @classmethod
    def _path(cls, v, info):
        if isinstance(v, Path):
            v = str(v)
        if info.field_name in PATHS and v is not None and not isinstance(v, str):
            raise ValueError(f"{info.field_name} must be a path (str or Path), got {type(v).__name__}")
        return os.path.expanduser(v) if info.field_name in PATHS and v else v  # `~` is the home folder

    @field_validator(*SIZES, mode="before")
    @classmethod
    def _size(cls, v):
        return v if v is None else parse_bytes(v)

    @field_validator("train", mode="before")
    @classmethod
    def _train(cls, v):
        if not isinstance(v, TrainSpec):
            raise ValueError(f"train must be a TrainSpec, e.g. TrainSpec(micro_batch=1, seq_len=4096), got "
                             f"{type(v).__name__}")
        return v

    @field_validator("host_policy", mode="before")
    @classmethod
    def _policy(cls, v):
        from megatrain.planner.host_policy import read_request

        if not isinstance(v, str):
            raise ValueError(f"host_policy must be 'auto' or a policy's name, got {type(v).__name__}")
        return read_request(v)

    @field_validator("resident", mode="before")
    @classmethod
    def _resident(cls, v):
        places = ("host", "weights", "device")
        if isinstance(v, str) and v in ("auto", "none"):
            return v
        if isinstance(v, dict) and all(isinstance(k, str) and p in places for k, p in v.items()):
            return v
        raise ValueError(f"resident must be auto, none or a table of unit names to {', '.join(places)}, e.g. "
                         f"{{embed = \"device\"}}; got {v!r:.60}")

    def replace(self, **changes) -> RunConfig:
        """A copy with `changes`, validated."""
        return type(self)(**{**dict(self), **changes})

    # -- the flat form: what a run prints, a manifest stores and a run file holds ------------------------------
    def settings(self) -> dict:
        """Every setting that is not None, by setting name, as JSON values."""
        out = {}
        for name, value in dict(self).items():
            if name == "train":
                out.update({setting(f): v for f, v in value.model_dump(mode="json").items() if v is not None})
            elif name in SIZES and value is not None:
                out[setting(name)] = _size_text(value)
            elif value is not None:
                out[setting(name)] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        return out

    @classmethod
    def from_settings(cls, settings: dict) -> RunConfig:
        """The RunConfig of flat settings (names with dashes or underscores); an error names the setting's flag.
        `recipe` (planner/train.py RECIPES) fills the optimizer settings left out; then a warmup left out is 10%
        of the steps, a micro-batch 1 (the CLI's defaults). The recipe is not itself a setting of the run: the
        values it filled in are, so `settings()` holds what the run does whatever named it."""
        given = {k.replace("-", "_"): v for k, v in settings.items()}
        unknown = sorted(set(given) - set(schema()))
        if unknown:
            from difflib import get_close_matches

            near = get_close_matches(unknown[0], list(schema()), n=1, cutoff=0.75)
            hint = f" (did you mean {setting(near[0])!r}?)" if near else ""
            raise ValueError(f"unknown setting {setting(unknown[0])!r}{hint}; valid settings: "
                             f"{', '.join(setting(n) for n in schema())}")
        fields = {TRAIN_FIELDS.get(k, k): v for k, v in given.items() if k in TRAIN_FIELDS or k in TrainSpec.model_fields}
        if fields.get("clip_norm") == 0 and not isinstance(fields["clip_norm"], bool):
            fields["clip_norm"] = None  # 0 turns clipping off, as HF's max_grad_norm 0 does (and a recipe's clip)
        recipe = given.pop("recipe", None) or "megatrain"
        if recipe not in RECIPES:
            raise ValueError(f"--recipe {recipe!r} is not a recipe; use one of {', '.join(RECIPES)}")
        for field, value in RECIPES[recipe].items():
            fields.setdefault(field, value)
        steps = fields.get("total_steps")
        if "warmup_steps" not in fields and isinstance(steps, int) and not isinstance(steps, bool):
            fields["warmup_steps"] = max(1, steps // 10)
        fields.setdefault("micro_batch", 1)
        if isinstance(fields.get("betas"), str):
            fields["betas"] = _betas(fields["betas"])
        try:
            train = TrainSpec(**fields)
        except ValidationError as e:
            error = e.errors(include_url=False)[0]
            raise ValueError(describe({**error, "loc": ("train", *error["loc"])}, flag)) from None
        try:
            return cls(train=train, **{k: v for k, v in given.items() if k in cls.model_fields and k != "train"})
        except ConfigError as e:
            raise ValueError(describe(e.error, flag)) from None


TRAIN_FIELDS = {v: k for k, v in TRAIN_NAMES.items()}  # setting name -> TrainSpec field


class ConfigError(ValueError):
    """A RunConfig that does not validate: one line naming the field; `error` is pydantic's first error."""

    def __init__(self, error: dict):
        super().__init__(describe(error, lambda name: name))
        self.error = error


def setting(field: str) -> str:
    """A setting's name as a run file and the printed settings spell it: the flag without its dashes."""
    return TRAIN_NAMES.get(field, field).replace("_", "-")


def flag(field: str) -> str:
    return "--" + setting(field)


def schema() -> dict[str, object]:
    """Every setting (underscored) and its type annotation, in the order the settings print."""
    out = {}
    for name, info in RunConfig.model_fields.items():
        if name == "train":
            out.update({TRAIN_NAMES.get(f, f): i.annotation for f, i in TrainSpec.model_fields.items()})
        else:
            out[name] = info.annotation
    out["recipe"] = Literal[tuple(RECIPES)]  # defaults for the others (from_settings), not a setting of its own
    return out


def describe(error: dict, name) -> str:
    """One line for pydantic's `error`, the field called `name(field)`: its name, or its flag for the CLI."""
    loc = [str(p) for p in error.get("loc", ()) if p != "train"]
    field = loc[-1] if loc else ""
    model = TrainSpec if error.get("loc", ("",))[:1] == ("train",) else RunConfig
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error" or not field:  # our own validators' message: rename the fields it names
        names = {f for f in (*RunConfig.model_fields, *TrainSpec.model_fields) if "_" in f} | {field} - {""}
        named = re.sub(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b",
                       lambda m: name(m.group(1)), msg) if names else msg
        return named if not field or re.search(rf"\b{field}\b", msg) else f"{name(field)}: {named}"
    got, ctx, kind = error.get("input"), error.get("ctx") or {}, error["type"]
    info = model.model_fields.get(field)
    bounds = "".join(f" {op} {getattr(m, attr)}" for m in (info.metadata if info else ())
                     for attr, op in (("gt", ">"), ("ge", ">=")) if hasattr(m, attr))
    if kind == "missing":
        return f"{name(field)} is required"
    if kind == "greater_than" and ctx.get("gt") == 0 and isinstance(got, int):
        text = "a positive integer"
    elif kind in ("greater_than", "greater_than_equal", "finite_number"):
        nan = isinstance(got, float) and math.isnan(got)
        text = (f"a finite number{bounds}" if kind == "finite_number" and not nan else
                bounds.strip() or "a finite number")
    elif kind in ("less_than_equal", "less_than"):
        limit = ctx.get("le", ctx.get("lt"))
        text = (f"at most {limit:,} (a larger value is a typo)" if kind == "less_than_equal" else
                f"below {limit:,}")
    elif kind.startswith("int_"):
        text = "an integer"
    elif kind.startswith("float_"):
        text = "a number"
    elif kind.startswith("bool_"):
        text = "true or false"
    elif kind == "literal_error":
        text = f"one of {ctx.get('expected')}"
    else:
        return f"{name(field)}: {msg}"
    return f"{name(field)} must be {text}, got {got!r}"


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--betas {text!r} must be two numbers, e.g. 0.9,0.95") from None
    return b1, b2


def _size_text(n: int) -> str:
    """A byte count as the shortest exact size parse_bytes reads back: 6MiB, 80GiB, or the integer."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
