"""Getting a ModelIR for the planner: a preset name or config file, traced for a TrainSpec.

Where it sits: the CLI and `tune()` call `trace_model`, which wraps the tracer (`megatrain.ir.trace`) and
imports it lazily, so the planner itself imports without torch. Tests replace `trace_model` with a cached
version. Try it: `python -c "from megatrain.planner.loading import trace_model; print(trace_model('tiny', 1, 64, 'bf16'))"`.
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR


def trace_model(model, micro_batch: int, seq_len: int, dtype: str, target: str = "cuda") -> ModelIR:
    """Trace `model` (preset name, config file path, or ModelConfig) for micro-batches of micro_batch x
    seq_len, as `target` ("cuda", or "cpu" for the sim device) runs it."""
    from megatrain.ir.trace import trace
    from megatrain.models import load_model_config

    return trace(load_model_config(model), micro_batch, seq_len, dtype, target=target)
