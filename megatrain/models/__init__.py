"""megatrain.models: model configs, presets, and the streaming-unit templates with their eager twin.

layers.py (norms, RoPE, attention, MLP) -> units.py (embed, blocks, head; `templates`, `run_unit`) ->
eager.py (the whole model, its initial weights); config.py and presets.py describe a model, moe.py and
depth/ are the feed-forward and depth-mixing variants.
"""

from .config import ModelConfig
from .eager import EagerModel, build_eager, decays, init_into, init_weights
from .layers import StepInputs, packing, rope_tables
from .presets import PRESETS, ConfigError, load_model_config, preset
from .units import recompute_mode, run_unit, templates, tied_params, unit_names

__all__ = [
    "PRESETS", "ConfigError", "EagerModel", "ModelConfig", "StepInputs", "build_eager", "decays", "init_into",
    "init_weights", "load_model_config", "packing", "preset", "recompute_mode", "rope_tables", "run_unit",
    "templates", "tied_params", "unit_names",
]
