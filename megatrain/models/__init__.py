"""megatrain.models: model configs, presets, and the streaming-unit templates with their eager twin."""

from .binding import flat_layout, pack, run_unit, template_layout, views
from .config import ModelConfig
from .presets import PRESETS, ConfigError, load_model_config, preset
from .transformer import (
    EagerModel,
    StepInputs,
    build_eager,
    decays,
    init_into,
    init_weights,
    packing,
    recompute_mode,
    rope_tables,
    templates,
    tied_params,
    unit_names,
)

__all__ = [
    "PRESETS", "ConfigError", "EagerModel", "ModelConfig", "StepInputs", "build_eager", "decays", "flat_layout",
    "init_into", "init_weights", "load_model_config", "pack", "packing", "preset", "recompute_mode", "rope_tables",
    "run_unit", "template_layout", "templates", "tied_params", "unit_names", "views",
]
