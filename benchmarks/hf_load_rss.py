"""Peak host memory of loading a Hugging Face checkpoint into the host store, against the store's own bytes.

Where it sits: a measurement for docs/RESULTS.md (issue 12), not a test. It writes a random ~1B-parameter
Llama-family folder (bf16 safetensors, sharded as transformers shards) tensor by tensor, so the writer never
holds the model; then a fresh process allocates the host store for it and loads the weights as the Trainer
does (megatrain/runtime/hf_load.py), and reports its peak RSS (VmHWM) beside the store's bytes and the largest tensor.
The target: peak <= baseline (interpreter + torch) + store + largest tensor + 10%.
Run it: `.venv/bin/python benchmarks/hf_load_rss.py --model 1b --out hf-1b` (about 18 GiB of RAM for
the 1b preset in fp32: 16 B/param of store).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def write_folder(model: str, out: Path, shard_bytes: int) -> dict:
    """A random model folder for preset `model`: config.json (models.hf.hf_config) and bf16 shards."""
    import torch

    from megatrain.models import load_model_config
    from megatrain.models.eager import param_shapes
    from megatrain.models.hf import hf_config, hf_name
    from megatrain.runtime.tensorfiles import SafetensorsWriter

    config = load_model_config(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config, "bfloat16"), indent=2))
    specs = [(hf_name(n), torch.bfloat16, s) for n, s in param_shapes(config).items()]
    shards, size = [[]], 0
    for spec in specs:
        n = 2 * torch.Size(spec[2]).numel()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    g = torch.Generator().manual_seed(0)
    for name, shard in zip(names, shards):
        w = SafetensorsWriter(out / name, shard, {"format": "pt"})
        for tname, dtype, shape in shard:
            w.write(tname, (torch.randn(shape, generator=g) * 0.02).to(dtype))
        w.close()
    wmap = {t: name for name, shard in zip(names, shards) for t, _, _ in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return {"params": config.n_params(), "shards": len(names),
            "largest_tensor_bytes": max(2 * torch.Size(s).numel() for _, _, s in specs)}


def child(folder: Path, dtype: str) -> None:
    """Allocate the store for the folder's model and load it; print the figures as JSON."""
    import torch  # noqa: F401  (the baseline includes torch)

    from megatrain.ir.trace import trace
    from megatrain.models import load_model_config
    from megatrain.planner import TrainSpec
    from megatrain.runtime.hf_load import check_weights, load_weights
    from megatrain.runtime.store import HostStore

    config = load_model_config(folder)
    ir = trace(config, 1, 128, dtype, target="cpu")
    plan = check_weights(folder, config)
    baseline = _status("VmRSS")
    t0 = time.perf_counter()
    store = HostStore(ir, TrainSpec(micro_batch=1, seq_len=128, dtype=dtype), init=False)
    allocated = time.perf_counter()
    n = load_weights(plan, store)
    done = time.perf_counter()
    print(json.dumps({"baseline_rss": baseline, "peak_rss": _status("VmHWM"), "store_bytes": store.host_bytes(),
                      "tensors": n, "alloc_s": allocated - t0, "load_s": done - allocated}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", help="preset to write as a Hugging Face folder (default 1b)")
    p.add_argument("--dtype", default="fp32", help="compute dtype of the store (fp32: 16 B/param, bf16: 18)")
    p.add_argument("--out", help="folder for the checkpoint (default: a temporary one)")
    p.add_argument("--shard-size", type=float, default=1.0, help="GB per shard (default 1)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child), args.dtype)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.out or tmp) / f"hf-{args.model}"
        t0 = time.perf_counter()
        info = write_folder(args.model, folder, int(args.shard_size * 1e9))
        info["write_s"] = time.perf_counter() - t0
        run = subprocess.run([sys.executable, __file__, "--child", str(folder), "--dtype", args.dtype],
                             capture_output=True, text=True, check=True)
        info.update(json.loads(run.stdout.strip().splitlines()[-1]))
    extra = info["peak_rss"] - info["baseline_rss"] - info["store_bytes"]
    info["over_store_bytes"] = extra
    info["target_bytes"] = int(info["baseline_rss"] + 1.1 * (info["store_bytes"] + info["largest_tensor_bytes"]))
    info["within_target"] = info["peak_rss"] <= info["target_bytes"]
    gib = 2**30
    print(json.dumps(info))
    print(f"{args.model}: {info['params']:,} params in {info['shards']} bf16 shards; store {info['store_bytes'] / gib:.2f} GiB "
          f"({args.dtype}); peak RSS {info['peak_rss'] / gib:.2f} GiB = baseline {info['baseline_rss'] / gib:.2f} + store "
          f"+ {extra / 2**20:.0f} MiB (largest tensor {info['largest_tensor_bytes'] / 2**20:.0f} MiB); "
          f"load {info['load_s']:.1f} s; within store + largest tensor + 10%: {info['within_target']}")


if __name__ == "__main__":
    main()
