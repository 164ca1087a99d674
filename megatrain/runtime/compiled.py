"""Unit runners: how the engine calls a unit template, eagerly or through torch.compile (`--compile-units`).

Where it sits: the Engine (engine.py) runs every unit through `runners(...)[template]`, a callable with
models.run_unit's signature. Eager (the default) it is run_unit itself: streamed training then equals eager
PyTorch bit for bit. Compiled, each template gets a torch.compile'd function of its own (CPU inductor on the
sim device, CUDA on a GPU), whose kernels fuse the elementwise work, so results equal eager to fp32
round-off, not bit for bit (tests/runtime/test_compiled.py). Try it: `megatrain train --model tiny --device
sim --gpu-mem 6MiB --seq-len 64 --micro-batch 2 --compile-units`.

What is compiled: a block template's plain call (forward without or with autograd, the recompute of a
backward, validation). The embedding (a lookup: nothing to fuse) and the head run eagerly: compiled, the head's
graph saved its logits for backward where the eager loss chunks keep them from living at once (measured on
tiny: 131 kB over the plan's peak; at a 128k vocabulary and 8k tokens that is GiBs), so the plan's memory
timeline, which the eager trace gives, would not hold. A call with a mode (a depth mixing's record /
rebuild / side) runs eagerly, as does every unit of an MoE model (its routing uses context variables and a
data-dependent layout, which break graphs and would recompile per routing). Each template's function is a code object of its own, so dynamo's cache
of recompiles per function (grad mode, train/eval) is per template, not shared by all of them.

Cost: the first step compiles (tens of seconds on 2 cores for a small model, once per template and mode).
Memory: the compiled blocks' saved activations are inductor's choice, not the eager trace's the plan's
timeline comes from; measured, they are fewer (tests/runtime/test_compiled.py asserts the device peak stays
within the plan's), an upper bound the partitioner's recompute-cheap-ops default keeps but does not promise.
Off by default: measured 4-21% faster per step at 2 threads and within noise at 1 on the 2-core test VM
(docs/RESULTS.md, issue 20), which does not pay for the toolchain it needs and the compile time.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from megatrain.files import cache_root
from megatrain.models import ModelConfig, run_unit


def _unit_call(template, bound, carry, inputs):
    return functional_call(template, bound, (carry, inputs), strict=True)


def _compiled(name: str, template: nn.Module) -> Callable:
    code = _unit_call.__code__.replace(co_name=f"unit_{name.replace('.', '_')}")
    fn = types.FunctionType(code, _unit_call.__globals__, code.co_name)
    _inductor_cache()
    compiled = torch.compile(fn)  # NOTE: static shapes first; a shape that changes (packed documents) goes dynamic

    def run(template_, params, carry, inputs, buffers=None, **mode):
        mode.pop("recompute", None)  # compiled, a recompute runs the whole forward (models/unevaluated.py is eager)
        if mode:  # a depth mixing's record / rebuild / side: eager
            return run_unit(template_, params, carry, inputs, buffers, **mode)
        bound = params if not buffers else {**params, **buffers}
        return compiled(template_, bound, carry, inputs)

    return run


def _inductor_cache() -> None:
    """inductor's kernels go in megatrain's cache (else they stay in /tmp/torchinductor_<user>), unless the user
    placed them (TORCHINDUCTOR_CACHE_DIR); set before inductor first asks, which fixes it for the process."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def check_toolchain(kind: str) -> None:
    """Refuse --compile-units up front where inductor cannot build kernels: on the sim device it compiles C++
    (a compiler on PATH, as torch._inductor.config.cpp.cxx names it), on CUDA it needs Triton."""
    import importlib.util
    import shutil

    _inductor_cache()

    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("--compile-units on CUDA needs Triton (torch.compile's GPU backend), which is not "
                             "installed: install the triton wheel matching torch, or drop --compile-units")
        return
    from torch._inductor import config

    names = [c for c in config.cpp.cxx if c] or ["g++"]
    if not any(shutil.which(c) for c in names):
        raise ValueError(f"--compile-units on the {kind} device needs a C++ compiler ({' or '.join(names)}) on "
                         "PATH: torch.compile builds CPU kernels with it; install one or drop --compile-units")


EAGER_TEMPLATES = ("embed", "head")  # a lookup, and a loss whose chunking exists to bound its memory


def runners(config: ModelConfig, templates: dict[str, nn.Module], compile_units: bool) -> dict[str, Callable]:
    """template name -> the callable the engine runs it with (module docstring)."""
    if not compile_units or config.moe is not None:
        return {name: run_unit for name in templates}
    return {name: run_unit if name in EAGER_TEMPLATES else _compiled(name, t) for name, t in templates.items()}
