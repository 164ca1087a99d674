"""The host optimizer in one pass: host_kernel.c, compiled on first use and loaded with ctypes.

Where it sits: host_state.adamw_step runs `adamw` (`step` for each parameter) when `available()`; otherwise it runs
the same update as a sequence of torch ops (host_adamw.adamw). Both give the same bits: the C loop performs torch's
fused CPU AdamW's fp32 operations in torch's order (host_kernel.c says how), and `available` checks that on this
machine, against the torch path, for every policy, with and without a clip factor, before the first step uses it
(`self_check`). A machine where any bit differs, with no C compiler, or whose torch is not vectorised for AVX2 /
AVX-512 (the only lane widths whose scalar tail host_kernel.c reproduces) runs the torch path and says why once
(`why_not`).

Why: each policy's step is then one read and one write of each byte it holds (HostPolicy.traffic), where the
torch path needs a pass per dtype expansion and rounding, clip multiply and fused kernel over each
cache-sized chunk (docs/RESULTS.md "Host optimizer throughput").

The same library holds the compute-dtype cast (cast_kernel.c: declared and checked against torch's
.to(torch.bfloat16) here, `_check_cast`; run by cast_kernel.py) and the step that also writes a bf16 copy of the
weights (`step(..., copy=)`, the `copy` place of planner/cast.py).

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
from megatrain.planner.host_policy import FP8_BLOCK, POLICIES
from megatrain.planner.train import TrainSpec

from . import host_adamw, stochastic_round

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_kernel.c")
CAST_SOURCE = Path(__file__).with_name("cast_kernel.c")  # the compute-dtype cast (planner/cast.py), same library
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
GCC_FLAGS = ["--param", "vect-epilogues-nomask=0"]  # no vectorised epilogues: the loops handle their own tails, and the build is faster
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
                ("moments", ctypes.c_int32), ("sr_seed", ctypes.c_uint32), ("origin", ctypes.c_int64)]


_state: dict = {}  # "lib", "lanes", "why_not", "pool", "pool_size"; the checked cast: "cast_lib", "cast_why_not"
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
        _declare(lib)
    except (OSError, ValueError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _state["why_not"] = f"could not build or load {SOURCE.name}: {e}"
        return
    _check_cast(lib)  # NOTE: the cast is checked on its own: it does not depend on torch's AdamW tails
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


def _declare(lib) -> None:
    """ctypes signatures of the library's entry points: host_kernel.c's and cast_kernel.c's."""
    lib.mt_adamw.restype = None
    lib.mt_adamw.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.POINTER(Hyper)]
    lib.mt_fp8_check.restype = ctypes.c_int64
    lib.mt_fp8_check.argtypes = [ctypes.c_uint32] * 3
    lib.mt_bf16_check.restype = ctypes.c_int64
    lib.mt_bf16_check.argtypes = [ctypes.c_uint32] * 3
    lib.mt_cast_bf16.restype = None
    lib.mt_cast_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.mt_cast_check.restype = ctypes.c_int64
    lib.mt_cast_check.argtypes = [ctypes.c_uint32] * 3
    lib.mt_adamw_copy.restype = None
    lib.mt_adamw_copy.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2


def special_values() -> torch.Tensor:
    """fp32 values where a bf16 rounding can go wrong: zeros, infinities, NaNs of both signs with several
    payloads, the subnormals' ends, the largest finite (rounds to inf), and halfway cases with an even and an
    odd last kept bit, each of both signs."""
    pos = [0x00000000, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x00000001, 0x00007FFF,
           0x00008000, 0x00018000, 0x007FFFFF, 0x00800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,
           0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F800000, 0x4B3F8000]
    bits = pos + [u | 0x80000000 for u in pos]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _check_cast(lib) -> None:
    """Use `lib`'s cast (cast_kernel.py) only if it gives torch's bits: special values at every offset of a
    vector and its tail, and 2^20 random bit patterns (NaNs and subnormals among them)."""
    gen = torch.Generator().manual_seed(0)
    cases = [special_values()]
    cases += [torch.cat([torch.randn(k, generator=gen), special_values()]) for k in range(0, 33)]
    cases.append(torch.randint(-2**31, 2**31, (1 << 20,), dtype=torch.int64, generator=gen).to(torch.int32)
                 .view(torch.float32))
    for x in cases:
        want, got = x.to(torch.bfloat16), torch.empty(x.numel(), dtype=torch.bfloat16)
        lib.mt_cast_bf16(x.data_ptr(), got.data_ptr(), x.numel())
        if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
            bad = (want.view(torch.int16) != got.view(torch.int16)).nonzero()[0].item()
            _state["cast_why_not"] = (f"its bits differ from torch's .to(bfloat16) on this machine (fp32 "
                                      f"bits {x.view(torch.int32)[bad].item() & 0xFFFFFFFF:#010x})")
            return
    _state["cast_lib"] = lib


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





def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         avg_scale: torch.Tensor | None, sq_scale: torch.Tensor | None, *, lr: float, betas: tuple[float, float],
         weight_decay: float, eps: float, step: float, factor: float = 1.0, copy: torch.Tensor | None = None,
         seed: int = 0, origin: int = 0) -> None:
    """One AdamW update of the contiguous fp32 `param` in place (torch's fused kernel's bits) from `grad` (fp32
    or bf16) times `factor` (the clip factor; 1: unclipped), and moments of any of MOMENTS' dtypes (fp8: with their
    per-block scales); `step` is the count after the update. With `copy` (bf16, param's size; only where
    cast_kernel.available()) the updated weights are also cast into it, in the same pass (cast_kernel.c).
    bf16 moments are rounded stochastically with `seed` (stochastic_round.step_seed), element i of these
    tensors as element origin + i of its parameter."""
    lib, n = _state["lib"], param.numel()
    for t in (param, grad, exp_avg, exp_avg_sq, *(() if copy is None else (copy,))):
        assert t.is_contiguous() and t.device.type == "cpu" and t.numel() == n
    assert param.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16)
    assert exp_avg.dtype == exp_avg_sq.dtype and (exp_avg.dtype != torch.float8_e4m3fn or avg_scale is not None)
    hyper = Hyper(lr, betas[0], betas[1], weight_decay, eps, step, factor,
                  int(grad.dtype == torch.bfloat16), MOMENTS[exp_avg.dtype], seed, origin)
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


def adamw(params, grads, moments, steps, cfg: TrainSpec, lr: float, decay, clip, copies=None) -> None:
    """host_state.adamw_step (its arguments' meaning) through the C loop, each parameter in one `step`."""
    clip = host_adamw.unclipped(clip)
    for wd, group, into in host_adamw.groups(params, grads, moments, steps, cfg, decay, copies):
        _one_pass(*group, cfg, lr, wd, clip, into)


def _one_pass(params, grads, moments, steps, cfg, lr, wd, clip, copies=None) -> None:
    # every policy multiplies by the clip factor, as clip_grad_norm_ does (g * 1.0 is g: unclipped is factor 1)
    factor = 1.0 if clip is None else float(clip)
    in_pass = "cast_lib" in _state  # the checked cast writes the copy in the step's pass; else torch's, after
    for k, (p, g, mom, count) in enumerate(zip(params, grads, moments, steps)):
        copy = copies[k].view(-1) if copies is not None else None
        at = int(count) + 1
        step(p.view(-1), g.view(-1), mom.exp_avg.view(-1), mom.exp_avg_sq.view(-1), mom.avg_scale, mom.sq_scale,
             lr=lr, betas=cfg.betas, weight_decay=wd, eps=cfg.eps, step=float(at), factor=factor,
             copy=copy if in_pass else None, seed=stochastic_round.step_seed(mom.key, at), origin=mom.origin)
        if copy is not None and not in_pass:
            copy.copy_(p.view(-1))
        count.add_(1)


def self_check() -> str:
    """'' when the loaded library gives host_adamw's torch-op bits for every policy, with and without a clip
    factor, on tensors with vector bodies, scalar tails and partial fp8 blocks, over three steps (bf16 and fp8
    moments then hold rounded values); else what differed first."""
    gen = torch.Generator().manual_seed(0)
    # tails of 15 and 13 elements: a kernel assuming 8 lanes where torch has 16 (or the reverse) differs there
    shapes = [(3 * FP8_BLOCK + 15,), (40, 16), (29,), (5,)]
    cfg = TrainSpec(micro_batch=1, seq_len=1)
    decay = [True, False, True, False]
    for name in POLICIES:
        for clip in (None, torch.tensor(0.37)):
            runs = []
            for one_pass in (False, True):
                gen.manual_seed(1)
                params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
                moments = [host_adamw.new_moments(name, s, f"check.{i}") for i, s in enumerate(shapes)]
                for i, m in enumerate(moments):
                    m.origin = 977 * i  # a shard's slice: bf16 moments draw by the index in the parameter
                steps = [torch.zeros(()) for _ in shapes]
                for k in range(3):
                    grads = [(torch.randn(s, generator=gen) * 10.0 ** -k).to(host_adamw.grad_dtype(name))
                             for s in shapes]
                    grads[0][:7] = 0  # a moment that decays towards the fp8 floor
                    grads[2][:4] *= 1e-21  # squares below fp32's least normal
                    grads[2][4:8] *= 1e-18  # second moments subnormal in bf16 too (vcvtneps2bf16 flushes them)
                    if one_pass:
                        adamw(params, grads, moments, steps, cfg, 1e-3, decay, clip)
                    else:
                        host_adamw.adamw(name, params, grads, moments, steps, cfg, 1e-3, decay, clip)
                runs.append([*params, *(t for m in moments for t in m.tensors().values())])
            for i, (a, b) in enumerate(zip(*runs)):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    return f"policy {name}, clip {clip is not None}, tensor {i}"
    return ""
