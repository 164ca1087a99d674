"""Hardware profiles: what the estimator needs to know about a machine, as a frozen pydantic value.

Where it sits: an input of `plan()` next to the ModelIR and the TrainSpec. Presets carry sourced nominal
figures turned into achievable ones by stated factors; `megatrain probe --out FILE` measures a machine and
writes the same JSON that `load_hardware(FILE)` and `--hardware FILE` read.
Try it: `python -c "from megatrain.planner import hardware_preset; print(hardware_preset('h100-sxm'))"`.

NOTE: nominal datasheet figures are not achievable. Presets apply three stated factors (`probe` replaces
them with measurements, which is what FlexGen found necessary):
- matmul: 75% of the dense tensor-core peak (the roofline that torch's RuntimeEstimator uses);
- host<->device link: 85% of the nominal per-direction bandwidth for pinned copies (PCIe Gen5 x16: ~54 of
  64 GB/s is what pinned cudaMemcpyAsync typically reaches);
- host memory for AdamW: 50% of one socket's nominal DRAM bandwidth (a streaming kernel over 7 arrays on
  the socket the optimizer threads are bound to).
The compute-dtype cast (planner/cast.py) has its own rates: the host's fp32 -> bf16 cast per thread count
(`host_cast_elements_per_s`, on the h2d worker's `cast_threads`) and the GPU's (`device_cast_elements_per_s`).
GPU presets state a conservative figure for the first (HOST_CAST, below what was measured, see there) and
DEVICE_CAST_EFFICIENCY of the HBM's nominal bandwidth over 6 B (read 4, write 2) for the second.
For data parallelism (planner/world.py, collectives.py) presets also carry the per-GPU bandwidth of collectives
inside a node (NVLink, or PCIe where there is none) and between nodes (each GPU's own NIC), at 80% of nominal
per direction (COLLECTIVE_EFFICIENCY: what NCCL's ring bus bandwidth reaches of the link), and the node's CPU
sockets (the ranks of a node share its host memory bandwidth by socket).
Store creation (runtime/host_init.py, priced by planner/creation.py as the time to the first step) has two
rates: the first touch of the store's fresh memory (`host_touch_bytes_per_s`) and the drawing of the initial
weights (`host_init_params_per_s`). GPU presets assume SERVER_TOUCH's figures; a profile that names
neither (the `cpu` preset, one written before they existed) gets the 2-core CI VM's figures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from megatrain.files import read_json
from megatrain.ir.base import IRModel

from .bytesize import format_bytes
from .profile import UnitProfile

GiB = 2**30
# Store creation, where a profile does not say: round figures at the low end of what the 2-core CI VM reached
# creating a 9 GiB store (docs/RESULTS.md "Store creation (time to first step)"; its first touch faults in the
# hypervisor too), so a profile without them predicts too long rather than too short.
DEFAULT_TOUCH_BYTES_PER_S = 4e8
DEFAULT_INIT_PARAMS_PER_S = 1.5e8
# GPU servers: assumed, not measured: 16 creation threads, each first touching as fast as the kernel zeroes 2 MiB
# pages and drawing normal values a little slower than one core of the CI VM did
SERVER_TOUCH = {"host_touch_bytes_per_s": 40e9, "host_init_params_per_s": 4e9}
# Checkpoint writes (planner/checkpoint_writes.py): assumed, not measured, for every preset: one datacenter NVMe
# drive's sustained sequential write with fsync, at the low end of what such drives state (2-7 GB/s), behind the
# sha256 the writing thread takes of every byte in series (runtime/tensorfiles.py; 1.7 GB/s on a core of the CI
# VM, about 2 on a server core with SHA extensions): 1 GB/s; and a file's fsync on a drive without power-loss
# protection. `megatrain probe --checkpoint-dir DIR` measures the folder a run writes to, hash included.
DISK_WRITE_BYTES_PER_S = 1e9
# Checkpoint reads (a resume streamed into its first step, planner/checkpoint_reads.py): the write figure, not
# measured either; such drives state higher sequential reads than writes, but the read is hashed in series too.
DISK_READ_BYTES_PER_S = 1e9
DISK_FILE_LATENCY_S = 1e-3
MATMUL_EFFICIENCY = 0.75
LINK_EFFICIENCY = 0.85
HOST_BW_EFFICIENCY = 0.5
COLLECTIVE_EFFICIENCY = 0.8
DEVICE_CAST_EFFICIENCY = 0.5  # of nominal HBM bandwidth: a conversion kernel streams, far below any preset's link
# of nominal HBM bandwidth: what a device-resident unit's AdamW step (torch's fused kernel, a streaming
# elementwise pass over weights, gradients and moments) is priced at; `megatrain probe` measures the step itself
DEVICE_MEMORY_EFFICIENCY = 0.5
CAST_BYTES = 4 + 2  # per element cast: read the fp32, write the bf16
# A GPU host's h2d worker casts on 2 threads (runtime/cpus.py). Per thread count, elements/s: the low end of what
# torch's copy_ measured there (2-5 G/s on the h2d worker's two threads, the issue that added planner/cast.py)
# and of the C cast (runtime/cast_kernel.c) at one thread on the 2-core EPYC VM (docs/RESULTS.md, "Compute-dtype
# cast"), where both are bound by one core's memory bandwidth; `megatrain probe` measures a machine's own.
HOST_CAST = {1: 2.0e9, 2: 3.5e9}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


class Hardware(IRModel):
    """One GPU and its host, as the cost model sees them. Rates are achievable, not nominal."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(description="preset name or a label for a measured profile")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="what runs the units: a CUDA GPU, or the CPU-backed sim device (traced for CPU kernels)"
    )
    gpu_memory_bytes: int = Field(gt=0, description="device memory of the GPU (the default budget)")
    matmul_flops: dict[str, float] = Field(
        description="achievable matmul FLOP/s per compute dtype ('bfloat16', 'float32')"
    )
    peak_flops: dict[str, float] = Field(description="nominal dense peak FLOP/s per compute dtype, for MFU")
    h2d_bytes_per_s: float = Field(gt=0, description="achievable pinned host-to-device copy bandwidth")
    d2h_bytes_per_s: float = Field(gt=0, description="achievable pinned device-to-host copy bandwidth")
    host_memory_bytes: int = Field(gt=0, description="host memory available to the trainer")
    host_memory_bytes_per_s: float = Field(gt=0, description="host DRAM bandwidth the AdamW step achieves")
    host_optimizer_bytes_per_s: dict[str, float] = Field(
        default_factory=dict, description="per host policy (host_policy.py): the bytes/s its optimizer step "
        "achieved in `megatrain probe` (its traffic x parameters/s); a policy without one is priced at "
        "host_memory_bytes_per_s")
    host_touch_bytes_per_s: float = Field(
        DEFAULT_TOUCH_BYTES_PER_S, gt=0, description="bytes/s at which a new host store's memory is first "
        "touched on its creation threads (runtime/host_init.py: page faults, zero-filled where zero is the "
        "initial value; `megatrain probe`)")
    host_init_params_per_s: float = Field(
        DEFAULT_INIT_PARAMS_PER_S, gt=0, description="initial weights drawn per second, all threads together "
        "(models.init_into: one generator per tensor, tensors in parallel; `megatrain probe`)")
    host_stream_bytes_per_s: float | None = Field(
        None, gt=0, description="measured host memory bandwidth of a streaming in-place update (bytes read + "
        "written per s; `megatrain probe`): the bound the host optimizer's throughput is compared with")
    allocator_margin: float = Field(
        0.05, ge=0, le=1, description="fraction added to the predicted device peak for allocator rounding"
    )
    reserved_bytes: int = Field(
        GiB, ge=0, description="device bytes the allocator never sees (CUDA context, library workspaces)"
    )
    op_overhead_s: float = Field(
        5e-6, ge=0, description="dispatch cost per fx graph node of a unit (kernel launch, Python)"
    )
    copy_latency_s: float = Field(1e-5, ge=0, description="fixed cost of one copy on a link")
    intra_node_bytes_per_s: float | None = Field(
        None, gt=0, description="achievable per-GPU bandwidth of a ring collective among the GPUs of one node, one "
        "direction (NVLink; PCIe where there is none); needed to plan --nproc > 1")
    inter_node_bytes_per_s: float | None = Field(
        None, gt=0, description="achievable per-GPU bandwidth between nodes, one direction (each GPU's own NIC); "
        "needed to plan --nnodes > 1")
    collective_latency_s: float = Field(2e-5, ge=0, description="fixed cost of one collective")
    host_cast_elements_per_s: dict[int, float] = Field(
        default_factory=dict, description="fp32 -> bf16 elements/s of the host cast into pinned memory, per thread "
        "count (runtime/cast_kernel.py: the C loop where it runs, else torch's copy_; `megatrain probe`); {}: "
        "priced at host_memory_bytes_per_s / 6 B, as before it was measured")
    cast_threads: int = Field(1, ge=1, description="threads the h2d stream's worker casts on in a run "
                              "(runtime/cpus.py): which of host_cast_elements_per_s a 'host' cast runs at")
    device_cast_elements_per_s: float | None = Field(
        None, gt=0, description="fp32 -> bf16 elements/s of a cast on the device (the 'gpu' placement of "
        "planner/cast.py); None: not known, so the planner does not offer it")
    device_memory_bytes_per_s: float | None = Field(
        None, gt=0, description="device memory bandwidth a streaming elementwise kernel achieves: what the AdamW "
        "step of a unit whose state lives on the device (issue 40) is priced at; None: priced at "
        "host_memory_bytes_per_s")
    disk_write_bytes_per_s: float = Field(
        DISK_WRITE_BYTES_PER_S, gt=0, description="bytes/s a checkpoint's files are written and fsynced at, in "
        "the checkpoint folder (`megatrain probe --checkpoint-dir DIR` measures it; presets assume one NVMe drive)")
    disk_read_bytes_per_s: float = Field(
        DISK_READ_BYTES_PER_S, gt=0, description="bytes/s a checkpoint's files are read and hashed at when a run "
        "resumes (the first step streams them in, planner/checkpoint_reads.py; `megatrain probe --checkpoint-dir DIR` "
        "measures it; presets assume the write rate)")
    disk_file_latency_s: float = Field(DISK_FILE_LATENCY_S, ge=0, description="fixed cost of writing and fsyncing "
                                       "one checkpoint file")
    host_sockets: int = Field(1, ge=1, le=64, description="CPU sockets of a node: ranks on different sockets "
                              "step their host optimizers on separate DRAM (host_memory_bytes_per_s is one's)")
    source: str = Field("", description="where the figures come from")
    units: UnitProfile | None = Field(None, description="measured op costs of one model shape on this device "
                                      "(`megatrain probe --model`, planner/profile.py): the cost model prices "
                                      "the units it covers from them instead of the rates above")

    @field_validator("matmul_flops", "peak_flops", mode="before")
    @classmethod
    def _canonical_dtypes(cls, v: dict) -> dict:
        if not isinstance(v, dict) or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                              for x in v.values()):
            raise ValueError("expected an object of dtype names and FLOP/s, e.g. {\"bfloat16\": 7.4e14}")
        for k, x in v.items():
            if not (math.isfinite(x) and x > 0):
                raise ValueError(f"{k} must be a finite FLOP/s > 0, e.g. 7.4e14, got {x}; measure it with "
                                 "megatrain probe")
        return {DTYPE_ALIASES.get(k, k): float(x) for k, x in v.items()}

    @field_validator("host_optimizer_bytes_per_s", "host_cast_elements_per_s")
    @classmethod
    def _positive_rates(cls, v: dict) -> dict:
        for k, x in v.items():
            if not x > 0:
                raise ValueError(f"{k} must be a rate > 0 per second, got {x}; measure it with megatrain probe")
            if isinstance(k, int) and k < 1:
                raise ValueError(f"thread count {k} must be >= 1")
        return v

    def host_cast_rate(self, threads: int | None = None) -> float:
        """fp32 -> bf16 elements/s of the host cast on `threads` (default: cast_threads): the rate measured at
        that count, else at the largest count measured below it, else host_memory_bytes_per_s / 6 B."""
        threads = self.cast_threads if threads is None else threads
        below = [k for k in self.host_cast_elements_per_s if k <= threads]
        if below:
            return self.host_cast_elements_per_s[max(below)]
        return self.host_memory_bytes_per_s / CAST_BYTES

    def flops(self, dtype: str) -> float:
        """Achievable matmul FLOP/s in `dtype`."""
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in self.matmul_flops:
            raise ValueError(f"hardware {self.name!r} has no matmul rate for {dtype}; it has "
                             f"{sorted(self.matmul_flops)}: add one to the profile or run `megatrain probe`")
        return self.matmul_flops[dtype]

    def peak(self, dtype: str) -> float:
        dtype = DTYPE_ALIASES.get(dtype, dtype)
        return self.peak_flops.get(dtype, self.flops(dtype))

    def gpu_bytes(self, device_peak_bytes: int) -> int:
        """What the GPU needs when the Program peaks at `device_peak_bytes` (buffers + workspace):
        reserved + ceil(peak x (1 + allocator margin))."""
        return self.reserved_bytes + math.ceil(device_peak_bytes * (1 + self.allocator_margin))

    def device_bytes_for(self, budget_bytes: int) -> int:
        """The most the Program may use under `budget_bytes`: the largest p with gpu_bytes(p) <= budget."""
        p = max(0, int((budget_bytes - self.reserved_bytes) / (1 + self.allocator_margin)))
        while p > 0 and self.gpu_bytes(p) > budget_bytes:
            p -= 1
        while self.gpu_bytes(p + 1) <= budget_bytes:
            p += 1
        return p

    def describe(self) -> str:
        bf = self.matmul_flops.get("bfloat16")
        return (f"{self.name}: {format_bytes(self.gpu_memory_bytes)} GPU, "
                f"{_flops(bf)} bf16, " if bf else f"{self.name}: ") + (
                f"h2d {self.h2d_bytes_per_s / 1e9:.1f} GB/s, d2h {self.d2h_bytes_per_s / 1e9:.1f} GB/s, "
                f"host {format_bytes(self.host_memory_bytes)} at {self.host_memory_bytes_per_s / 1e9:.0f} GB/s")


def _flops(x: float) -> str:
    return f"{x / 1e12:.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _nominal(name: str, *, gpu_gib: float, bf16_tflops: float, fp32_tflops: float, link_gbs: float,
             host_gib: float, host_gbs: float, source: str, intra_gbs: float, nic_gbps: float, hbm_tbs: float,
             sockets: int = 1, **extra) -> Hardware:
    """A preset from nominal datasheet figures and the module's stated efficiency factors (`intra_gbs`: the
    GPU's intra-node link per direction in GB/s; `nic_gbps`: its NIC in Gb/s; `hbm_tbs`: its memory in TB/s)."""
    peak = {"bfloat16": bf16_tflops * 1e12, "float32": fp32_tflops * 1e12}
    extra = {**SERVER_TOUCH, **extra}
    extra.update(intra_node_bytes_per_s=intra_gbs * 1e9 * COLLECTIVE_EFFICIENCY,
                 inter_node_bytes_per_s=nic_gbps / 8 * 1e9 * COLLECTIVE_EFFICIENCY, host_sockets=sockets,
                 host_cast_elements_per_s=HOST_CAST, cast_threads=2,
                 device_cast_elements_per_s=hbm_tbs * 1e12 * DEVICE_CAST_EFFICIENCY / CAST_BYTES,
                 device_memory_bytes_per_s=hbm_tbs * 1e12 * DEVICE_MEMORY_EFFICIENCY)
    return Hardware(
        name=name, gpu_memory_bytes=int(gpu_gib * GiB),
        matmul_flops={k: v * MATMUL_EFFICIENCY for k, v in peak.items()}, peak_flops=peak,
        h2d_bytes_per_s=link_gbs * 1e9 * LINK_EFFICIENCY, d2h_bytes_per_s=link_gbs * 1e9 * LINK_EFFICIENCY,
        host_memory_bytes=int(host_gib * GiB), host_memory_bytes_per_s=host_gbs * 1e9 * HOST_BW_EFFICIENCY,
        source=source + f"; achievable = {MATMUL_EFFICIENCY:.0%} matmul, {LINK_EFFICIENCY:.0%} link, "
        f"{HOST_BW_EFFICIENCY:.0%} host DRAM, {COLLECTIVE_EFFICIENCY:.0%} collectives of nominal; cast: host "
        f"{HOST_CAST[2] / 1e9:g} G elements/s on the h2d worker's 2 threads (HOST_CAST), GPU {hbm_tbs:g} TB/s HBM x "
        f"{DEVICE_CAST_EFFICIENCY:.0%} / 6 B; a device-resident AdamW step at {DEVICE_MEMORY_EFFICIENCY:.0%} of the "
        "HBM", **extra)


_PCIE5 = "PCIe Gen5 x16 64 GB/s per direction"
_PCIE4 = "PCIe Gen4 x16 32 GB/s per direction"
_SPR = "host: one Xeon Sapphire Rapids socket, 8 ch DDR5-4800 = 307 GB/s"
_NVL4 = "NVLink 4 900 GB/s per GPU = 450 GB/s per direction"
_NDR = "one ConnectX-7 400 Gb/s InfiniBand NDR per GPU"
PRESETS = {
    "h100-sxm": lambda: _nominal(
        "h100-sxm", gpu_gib=80, bf16_tflops=989.4, fp32_tflops=67, link_gbs=64, host_gib=2048, host_gbs=307,
        intra_gbs=450, nic_gbps=400, sockets=2, hbm_tbs=3.35,
        source=f"NVIDIA H100 SXM5 datasheet: 989.4 TFLOPS dense BF16, 67 TFLOPS FP32, 80 GB HBM3, {_NVL4}; {_PCIE5}; "
        f"DGX H100: 2 TB, two sockets, {_NDR}; {_SPR}"),
    "h100-pcie": lambda: _nominal(
        "h100-pcie", gpu_gib=80, bf16_tflops=756.5, fp32_tflops=51, link_gbs=64, host_gib=1024, host_gbs=307,
        intra_gbs=64, nic_gbps=400, hbm_tbs=2.0,
        source=f"NVIDIA H100 PCIe datasheet: 756.5 TFLOPS dense BF16, 51 TFLOPS FP32, 80 GB HBM2e at 2.0 TB/s; {_PCIE5} (its NVLink "
        f"bridge pairs two GPUs only: collectives among more go over PCIe); 1 TB host and {_NDR} assumed; {_SPR}"),
    "h200": lambda: _nominal(
        "h200", gpu_gib=140, bf16_tflops=989.4, fp32_tflops=67, link_gbs=64, host_gib=2048, host_gbs=307,
        intra_gbs=450, nic_gbps=400, sockets=2, hbm_tbs=4.8,
        source=f"NVIDIA H200 SXM datasheet: 989.4 TFLOPS dense BF16, 67 TFLOPS FP32, 141 GB HBM3e at 4.8 TB/s "
        f"(140 GiB as nvidia-smi reports), {_NVL4}; {_PCIE5}; DGX H200: 2 TB, two sockets, {_NDR}; {_SPR}"),
    "gh200": lambda: _nominal(
        "gh200", gpu_gib=96, bf16_tflops=989.4, fp32_tflops=67, link_gbs=450, host_gib=480, host_gbs=512,
        intra_gbs=450, nic_gbps=400, hbm_tbs=4.0,
        source="NVIDIA GH200 Grace Hopper datasheet: H100 with 96 GB HBM3 at 4 TB/s, 989.4 TFLOPS dense BF16; "
        "NVLink-C2C 900 GB/s total = 450 GB/s per direction; Grace 480 GB LPDDR5X at 512 GB/s; GPU-to-GPU NVLink "
        f"900 GB/s (NVL2/NVL32); {_NDR} assumed"),
    "a100-80g": lambda: _nominal(
        "a100-80g", gpu_gib=80, bf16_tflops=312, fp32_tflops=19.5, link_gbs=32, host_gib=1024, host_gbs=204.8,
        intra_gbs=300, nic_gbps=200, sockets=2, hbm_tbs=2.039,
        source=f"NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS dense BF16, 19.5 TFLOPS FP32, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 "
        f"GB/s per GPU = 300 GB/s per direction; {_PCIE4}; DGX A100: 1 TB, two sockets, one ConnectX-6 200 Gb/s "
        "HDR InfiniBand per GPU; host: one EPYC 7742 socket, 8 ch DDR4-3200 = 204.8 GB/s"),
    "rtx4090": lambda: _nominal(
        "rtx4090", gpu_gib=24, bf16_tflops=165.2, fp32_tflops=82.6, link_gbs=32, host_gib=128, host_gbs=89.6,
        intra_gbs=32, nic_gbps=100, hbm_tbs=1.008,
        source=f"NVIDIA Ada whitepaper RTX 4090: 165.2 TFLOPS dense BF16 (FP32 accumulate), 82.6 TFLOPS FP32, "
        f"24 GB GDDR6X at 1,008 GB/s, no NVLink (collectives over {_PCIE4}, through the host); desktop host 128 GB, 2 ch "
        "DDR5-5600 = 89.6 GB/s; 100 Gb/s Ethernet per GPU assumed"),
    "cpu": lambda: Hardware(
        name="cpu", device="cpu", gpu_memory_bytes=8 * GiB,
        matmul_flops={"bfloat16": 2e9, "float32": 5e10}, peak_flops={"bfloat16": 2e9, "float32": 5e10},
        h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, host_memory_bytes=16 * GiB, host_memory_bytes_per_s=1e10,
        allocator_margin=0.0, reserved_bytes=0, op_overhead_s=2e-5, copy_latency_s=2e-5,
        intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9, collective_latency_s=2e-4,
        host_cast_elements_per_s={1: 1e10 / CAST_BYTES}, cast_threads=1, device_cast_elements_per_s=1e10 / CAST_BYTES,
        device_memory_bytes_per_s=1e10,
        source="simulated device on a 2-core CI machine (runtime 'sim'): round figures below what "
        "`megatrain probe --device cpu` measured there (bf16 matmul 1.3-2.6 GFLOP/s without AMX, fp32 ~100 "
        "GFLOP/s, memcpy 4-10 GB/s, AdamW 16 GB/s, the fp32 -> bf16 cast 2.9-3.4 G elements/s at 1 thread, "
        "median: priced at the host bandwidth / 6 B, 1.67 G/s, on the h2d worker's 1 thread and for the sim "
        "device's own cast, torch's on that worker; the sim device's memory is host memory, so a device step "
        "is priced at the host's 10 GB/s); no margin or reserve because the sim pool is exact; "
        "collectives: gloo over localhost TCP, a round 1 GB/s and 0.2 ms each"),
}


GPU_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
             ("A100", "a100-80g"), ("RTX 4090", "rtx4090"))


def hardware_for_device(device: str, index: int = 0) -> Hardware:
    """The profile a device plans with when none is given: the sim device the `cpu` preset, a GPU (`index`)
    the preset its name matches (torch.cuda.get_device_name), else a one-line request for a measured profile;
    "auto" is the device make_device picks (cuda when available, else sim)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "sim"
    if device == "sim":
        return hardware_preset("cpu")
    name = torch.cuda.get_device_name(index) if torch.cuda.is_available() else ""
    match = next((preset for key, preset in GPU_NAMES if key in name), None)
    if match is None:
        raise ValueError(f"no hardware preset matches GPU {name!r}; run `megatrain probe --out gpu.json` "
                         "and pass --hardware gpu.json")
    return hardware_preset(match)


def hardware_preset(name: str) -> Hardware:
    """A preset by name: h100-sxm, h100-pcie, h200, gh200, a100-80g, rtx4090, cpu."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; use one of {', '.join(PRESETS)} "
                         "or a profile JSON written by `megatrain probe --out FILE`") from None


def load_hardware(path: str | Path) -> Hardware:
    """A profile from a JSON file (as written by `megatrain probe --out FILE`)."""
    path = Path(path)
    data = read_json(path, 1 << 20, "a hardware profile", fix="write one with `megatrain probe --out FILE`")
    try:
        return Hardware.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "profile"
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"hardware profile {path}: {loc}: {msg}; see `megatrain probe --help`") from None


def resolve_hardware(name_or_path: str | Hardware) -> Hardware:
    """A preset name or a JSON file path (what `--hardware` accepts)."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path)
    if text in PRESETS:
        return hardware_preset(text)
    if text.endswith(".json") or Path(text).exists():
        return load_hardware(text)
    return hardware_preset(text)
