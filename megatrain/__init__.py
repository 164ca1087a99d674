"""megatrain: train language models far larger than GPU memory on one GPU.

The pipeline (docs/DESIGN.md 2): `trace` a model into a ModelIR, `plan` a step under a GPU memory budget,
`compile` the plan into a Python step program, and train with the runtime (`Trainer`).
Names are imported lazily so that `megatrain vab ...` does not pay for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

if __import__("os").environ.get("MEGATRAIN_FAKE_CUDA", "") == "1":  # CUDA code on a CPU (fake_cuda/__init__.py)
    import_module("megatrain.fake_cuda").install_from_env()

_EXPORTS = {
    "trace": "megatrain.ir.trace",
    "ModelConfig": "megatrain.models",
    "build_eager": "megatrain.models",
    "load_model_config": "megatrain.models",
    "plan": "megatrain.planner",
    "tune": "megatrain.planner",
    "choose_rank": "megatrain.planner.depth_rank",
    "Hardware": "megatrain.planner",
    "TrainSpec": "megatrain.planner",
    "InfeasiblePlanError": "megatrain.planner",
    "emit": "megatrain.codegen",
    "Trainer": "megatrain.runtime.trainer",
    "Communicator": "megatrain.runtime.distributed",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
