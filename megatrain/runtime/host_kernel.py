"""The host optimizer in one pass: host_kernel.c, compiled on first use and loaded with ctypes.

Where it sits: host_state.adamw_step calls `step` for each parameter when `available()`; otherwise it runs the
same update as a sequence of torch ops (its `_exact` / `_compressed`). Both give the same bits: the C loop
performs torch's fused CPU AdamW's fp32 operations in torch's order (host_kernel.c says how), and `available`
checks that on this machine, against the torch path, for every policy, with and without a clip factor, before
the first step uses it. A machine where any bit differs, with no C compiler, or whose torch is not vectorised
for AVX2 / AVX-512 (the only lane widths whose scalar tail host_kernel.c reproduces) runs the torch path and
says why once (`why_not`).

Why: each policy's step is then one read and one write of each byte it holds (HostPolicy.traffic), where the
torch path needs a pass per dtype expansion and rounding, clip multiply and fused kernel over each
cache-sized chunk (docs/RESULTS.md "Host optimizer throughput").

The same library holds the compute-dtype cast (cast_kernel.c, loaded and checked by cast_kernel.py) and the
step that also writes a bf16 copy of the weights (`step(..., copy=)`, the `copy` place of planner/cast.py).

The library is built with the system C compiler (`$CC`, else cc, gcc or clang) at -O3 -march=native
-ffp-contract=off into $MEGATRAIN_CACHE/kernels (default ~/.cache/megatrain), keyed by the source, the flags,
the compiler and the machine, and reused; written to a temporary name and renamed, so ranks building at once
do not see half a file. MEGATRAIN_HOST_KERNEL=0 turns it off (benchmarks compare the two paths that way).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatrain.files import cache_root, write_atomic

from . import cast_kernel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_kernel.c")
CAST_SOURCE = Path(__file__).with_name("cast_kernel.c")  # the compute-dtype cast (planner/cast.py), same library
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
GCC_FLAGS = ["--param", "vect-epilogues-nomask=0"]  # no vectorised epilogues: 1.4 s to build instead of 2.5
BLOCK = 256  # host_kernel.c BLOCK: pieces split between threads start at multiples of it
BUILD_TIMEOUT_S = 300  # a compiler that hangs costs the run this much, then the torch path
MIN_PIECE = 1 << 18  # elements: smaller tensors are not split between threads
MOMENTS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# Per torch CPU capability, the granularity of fused AdamW's vector path: the last (numel mod it) elements of a
# tensor take the scalar formulas. AVX-512: torch's loop runs 16 lanes, and its compiler vectorised the scalar
# tail loop in 8 lanes, with the vector body's contraction (measured: tensors of 16k + 1..15 elements).
# AVX2: torch's 8 lanes (not measured here). Where the first guess fails the self-check, the others are tried
# in turn (a build whose compiler vectorised its tail otherwise); the check decides.
LANES = {"AVX512": 8, "AVX2": 8}
OTHER_LANES = (16, 4, 8, 1)


class Hyper(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("weight_decay", ctypes.c_double), ("eps", ctypes.c_double), ("step", ctypes.c_double),
                ("factor", ctypes.c_float), ("grad_bf16", ctypes.c_int32),
                ("moments", ctypes.c_int32)]


_state: dict = {}  # "lib", "lanes", "why_not", "pool", "pool_size"
_lock = threading.Lock()


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None)


def _cpu() -> str:
    """What -march=native compiles for: the machine and its CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {}
    for line in lines:
        k, _, v = line.partition(":")
        first.setdefault(k.strip(), v.strip())
    return "|".join([platform.machine(), first.get("model name", ""), first.get("flags", "")])


def _build() -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (cc, gcc or clang; or name one in $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False, timeout=30).stdout
    flags = FLAGS + ([] if "clang" in version.lower() else GCC_FLAGS)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), CAST_SOURCE.read_bytes(), " ".join(flags).encode(),
                                     version.encode(), _cpu().encode()])).hexdigest()[:16]
    out = _cache_dir() / f"host_kernel-{key}.so"
    digest = out.with_name(out.name + ".sha256")
    if _intact(out, digest):
        return out
    # NOTE: a cached library that is not byte for byte the one built (truncated, garbage, another library) is
    # built again: loading a truncated one kills the process with SIGBUS
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        run = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), str(CAST_SOURCE), "-lm"], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[:500]}")
        sha = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, out)
        write_atomic(digest, sha + "\n", "the kernel cache")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _intact(lib: Path, digest: Path) -> bool:
    """Whether `lib` is the library its build recorded in `digest` (its sha256), byte for byte."""
    try:
        return digest.read_text().strip() == hashlib.sha256(lib.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False


def _load() -> None:
    if os.environ.get("MEGATRAIN_HOST_KERNEL", "1") == "0":
        _state["why_not"] = "MEGATRAIN_HOST_KERNEL=0"
        return
    lanes = LANES.get(torch.backends.cpu.get_cpu_capability())
    if lanes is None:
        _state["why_not"] = f"torch's CPU capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2/AVX512"
        return
    try:
        lib = ctypes.CDLL(str(_build()))
        lib.mt_adamw.restype = None
        lib.mt_adamw.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.POINTER(Hyper)]
        lib.mt_fp8_check.restype = ctypes.c_int64
        lib.mt_fp8_check.argtypes = [ctypes.c_uint32] * 3
        lib.mt_bf16_check.restype = ctypes.c_int64
        lib.mt_bf16_check.argtypes = [ctypes.c_uint32] * 3
        cast_kernel.declare(lib)
    except (OSError, ValueError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _state["why_not"] = f"could not build or load {SOURCE.name}: {e}"
        return
    cast_kernel.check(lib)  # NOTE: the cast is checked on its own: it does not depend on torch's AdamW tails
    from .host_state import self_check  # NOTE: host_state imports this module; the check needs both paths

    first = None  # what the first guess got wrong: the likeliest tail, so the likeliest fault to name
    for guess in dict.fromkeys((lanes, *OTHER_LANES)):
        _state.update(lib=lib, lanes=guess)
        bad = self_check()
        if not bad:
            return
        first = first or f"{bad} with the scalar tail at {guess} lanes"
    _state.pop("lib")
    _state["why_not"] = f"its bits differ from torch's on this machine ({first}; and with the scalar tail at any " \
        f"of {', '.join(str(n) for n in dict.fromkeys((lanes, *OTHER_LANES)))} lanes)"


def available() -> bool:
    """Whether steps run through the kernel: built, loaded and checked on the first call (once per process;
    a second thread asking meanwhile waits for the answer)."""
    if "why_not" not in _state:
        with _lock:
            if "why_not" not in _state:
                _load()
                _state.setdefault("why_not", None)
                if _state["why_not"]:
                    log.warning("host optimizer: the one-pass kernel is off (%s); torch ops give the same bits, "
                                "slower", _state["why_not"])
    return "lib" in _state


def why_not() -> str | None:
    """Why the kernel is not used on this machine (None: it is)."""
    available()
    return _state.get("why_not")


def _check_on_every_core(check, stride: int) -> int:
    """An exhaustive check of host_kernel.c split between this process's cores (ctypes lets go of the GIL)."""
    parts = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(parts, thread_name_prefix="host-kernel-check") as pool:
        counts = list(pool.map(lambda part: check(stride, part, parts), range(parts)))
    return -1 if min(counts) < 0 else sum(counts)


def fp8_check(stride: int = 1) -> int:
    """How many inputs the AVX-512 fp8 conversions of host_kernel.c get wrong against its element functions
    (every code; every `stride`-th fp32 of [-448, 448] and a little past); -1 where that code is not built
    (no AVX-512)."""
    return _check_on_every_core(_state["lib"].mt_fp8_check, stride)


def bf16_check(stride: int = 1) -> int:
    """How many fp32 inputs the AVX512_BF16 rounding of host_kernel.c's bf16 moments gets wrong against c10's
    (every `stride`-th fp32 bit pattern); -1 where that code is not built (no AVX512_BF16)."""
    return _check_on_every_core(_state["lib"].mt_bf16_check, stride)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         avg_scale: torch.Tensor | None, sq_scale: torch.Tensor | None, *, lr: float, betas: tuple[float, float],
         weight_decay: float, eps: float, step: float, factor: float = 1.0, copy: torch.Tensor | None = None) -> None:
    """One AdamW update of the contiguous fp32 `param` in place (torch's fused kernel's bits) from `grad` (fp32
    or bf16) times `factor` (the clip factor; 1: unclipped), and moments of any of MOMENTS' dtypes (fp8: with their
    per-block scales); `step` is the count after the update. With `copy` (bf16, param's size; only where
    cast_kernel.available()) the updated weights are also cast into it, in the same pass (cast_kernel.c)."""
    lib, n = _state["lib"], param.numel()
    for t in (param, grad, exp_avg, exp_avg_sq, *(() if copy is None else (copy,))):
        assert t.is_contiguous() and t.device.type == "cpu" and t.numel() == n
    assert param.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16)
    assert exp_avg.dtype == exp_avg_sq.dtype and (exp_avg.dtype != torch.float8_e4m3fn or avg_scale is not None)
    hyper = Hyper(lr, betas[0], betas[1], weight_decay, eps, step, factor,
                  int(grad.dtype == torch.bfloat16), MOMENTS[exp_avg.dtype])
    args = (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _ptr(avg_scale),
            _ptr(sq_scale))
    nvec = n - n % _state["lanes"]
    threads = min(torch.get_num_threads(), max(1, n // MIN_PIECE))
    run = lib.mt_adamw if copy is None else lambda *a: lib.mt_adamw_copy(*a, copy.data_ptr())
    if threads <= 1:
        run(*args, 0, n, nvec, ctypes.byref(hyper))
        return
    piece = -(-n // threads // BLOCK) * BLOCK
    pool, size = _state.get("pool"), _state.get("pool_size", 0)
    if pool is None or size < threads:
        pool = _state["pool"] = ThreadPoolExecutor(threads, thread_name_prefix="host-adamw")
        _state["pool_size"] = threads
    jobs = [pool.submit(run, *args, a, min(n, a + piece), nvec, ctypes.byref(hyper))
            for a in range(0, n, piece)]
    for j in jobs:
        j.result()
