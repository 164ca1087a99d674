"""Export: a checkpoint's master weights, alone, as one safetensors file with Hugging Face LLaMA names.

Where it sits: after training. `megatrain export --checkpoint DIR --out model.safetensors [--dtype bf16]`
reads a checkpoint (checkpoint.py), verified unit by unit, and writes the weights for other tools. Peak
memory is one unit's weights. Run its tests: `.venv/bin/pytest tests/runtime/test_checkpoint.py -k export`.

Names (our unit-major names -> Hugging Face LlamaForCausalLM / Qwen2ForCausalLM):
  embed.embed_tokens.weight -> model.embed_tokens.weight
  blocks.{i}.<rest>         -> model.layers.{i}.<rest>  (input_layernorm, self_attn.{q,k,v,o}_proj (+ q/k/v
                               bias with qkv_bias, q_norm/k_norm with qk_norm), post_attention_layernorm,
                               mlp.{gate,up,down}_proj: the inner names are already Hugging Face's)
  head.norm.weight          -> model.norm.weight
  head.lm_head.weight       -> lm_head.weight  (absent with tied embeddings: the head does not own it)
Our RoPE is rotate-half, Hugging Face's convention, so q/k projections need no permutation.
Mixture-of-experts models (models/moe.py) have no LLaMA names: `--names megatrain` exports them, their unit
buffers (routing thresholds, biases) included under their own names, since inference needs them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .checkpoint import SafetensorsWriter, find_checkpoint, read_manifest, read_masters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_RULES = ((re.compile(r"embed\.(embed_tokens\.weight)"), r"model.\1"),
          (re.compile(r"blocks\.(\d+)\.(.+)"), r"model.layers.\1.\2"),
          (re.compile(r"head\.(norm\.weight)"), r"model.\1"),
          (re.compile(r"head\.(lm_head\.weight)"), r"\1"))


def hf_name(name: str) -> str:
    """Our parameter name as Hugging Face LLaMA-style models name it."""
    for pattern, repl in _RULES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    raise ValueError(f"parameter {name!r} has no Hugging Face LLaMA name; export with --names megatrain")


def export_weights(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", names: str = "hf") -> dict:
    """Write the master weights of `checkpoint` (a folder, or the latest in a folder of them) to `out`,
    atomically; returns a summary {checkpoint, step, tensors, params, bytes}."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if names not in ("hf", "megatrain"):
        raise ValueError(f"names {names!r}: use hf or megatrain")
    ckpt = find_checkpoint(checkpoint)
    manifest = read_manifest(ckpt)
    model = manifest["model"] if isinstance(manifest["model"], dict) else {}
    if names == "hf" and model.get("moe"):
        raise ValueError(f"{ckpt}: a mixture-of-experts model has no Hugging Face LLaMA names; export with "
                         "--names megatrain")
    rename = hf_name if names == "hf" else (lambda n: n)
    # buffers stay fp32: thresholds are compared with fp32 router logits
    specs = [spec for u in manifest["units"] for spec in (
        *((rename(p["name"]), DTYPES[dtype], tuple(p["shape"])) for p in u["params"]),
        *((b["name"], torch.float32, tuple(b["shape"])) for b in u.get("buffers", ())))]
    metadata = {"format": "pt", "megatrain_model": str(model.get("name", "")),
                "megatrain_step": str(manifest["step"])}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        writer = SafetensorsWriter(tmp, specs, metadata)
        try:
            for unit in manifest["units"]:  # one unit's weights in memory at a time
                buffers = {b["name"] for b in unit.get("buffers", ())}
                for name, t in read_masters(ckpt, manifest, unit, buffers=True).items():
                    if name in buffers:
                        writer.write(name, t)
                    else:
                        writer.write(rename(name), t.to(DTYPES[dtype]))
        except BaseException:
            writer.abort()
            raise
        record = writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(specs),
            "params": sum(int(torch.Size(s).numel()) for _, _, s in specs), "bytes": record["bytes"]}
