"""Model presets as plain functions, and loading a config from a JSON or TOML file.

Where it sits: the CLI's `--model NAME_OR_FILE` goes through `load_model_config`. Real models match their
published parameter counts (tests/models/test_presets.py checks them).

Chosen dims (no published model to match):
- tiny:   vocab 256 (bytes), d 128, 4 layers, 4 heads / 2 kv, SwiGLU 352: 0.80M params, for tests.
- small:  vocab 256 (bytes), d 448, 8 layers, 7 heads (head_dim 64), SwiGLU 1216: 19.7M, for CPU benchmarks.
- 125m:   GPT-2 vocab padded to 50304, tied, d 768, 12 layers, 12 heads, SwiGLU 2048: 123.6M.
- 455m:   vocab 50304, tied, d 1024, 32 layers, 16 heads, SwiGLU 2752: 456.3M.
- 1b:     vocab 50304, tied, d 2048, 18 layers, 16 heads, SwiGLU 5632: 1.028B.
  (The DepthSSD paper gives only the scales 125M/455M/1B; these dims are ours.)
- dense-120b: Llama-3 vocab 128256, d 12288, 76 layers, 96 heads / 8 kv (head_dim 128), SwiGLU 32768,
  untied: 119.8B, the size MegaTrain trains on one H200.
- dense-150b: dense-120b's width and vocab, 96 layers: 150.5B, the largest dense preset: on one H200 with
  1.5 TB of host memory it plans only with compressed AdamW moments (planner/host_policy.py).

Mixture-of-experts (models/moe.py; "active" counts the routed experts a token takes, top_k of E):
- moe-tiny: tiny's attention dims, block 0 dense (SwiGLU 352), blocks 1-3 MoE with 8 ReLU² experts of width
  128 + a shared one, ET routing (momentum 0.99, 10 warmup steps: scaled to CPU runs): 1.29M params, 0.60M
  active, for tests.
- et-d12: the ET paper's d12 (reference §4): vocab 65536, d 768, 12 layers, 6 heads / 2 kv (head_dim 128),
  QK-norm, untied; block 0 dense (SwiGLU 2048 ~ the paper's ReLU² 4d in parameters), 16 ReLU² experts of
  width 2d + 1 shared, ET with the paper's defaults: 565.6M params, 176.3M active (paper: 575M / 195M; with
  6 kv heads the total would be 575.0M).
- et-d20: d 1280, 20 layers, 10 heads (head_dim 128, no GQA), SwiGLU 3456 in block 0, else as et-d12:
  2.429B params, 561.6M active (paper: 2.43B / 561M).
  Deviations from the paper's nanochat base: learnable RMSNorm weights, no logit softcap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from megatrain.files import read_structured

from .config import ModelConfig, MoEConfig, one_line


def tiny() -> ModelConfig:
    return ModelConfig(name="tiny", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_dim=352, max_seq_len=1024)


def small() -> ModelConfig:
    return ModelConfig(name="small", vocab_size=256, d_model=448, n_layers=8, n_heads=7, ffn_dim=1216,
                       max_seq_len=1024)


def gpt_125m() -> ModelConfig:
    return ModelConfig(name="125m", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                       tie_embeddings=True, max_seq_len=2048)


def gpt_455m() -> ModelConfig:
    return ModelConfig(name="455m", vocab_size=50304, d_model=1024, n_layers=32, n_heads=16, ffn_dim=2752,
                       tie_embeddings=True, max_seq_len=2048)


def gpt_1b() -> ModelConfig:
    return ModelConfig(name="1b", vocab_size=50304, d_model=2048, n_layers=18, n_heads=16, ffn_dim=5632,
                       tie_embeddings=True, max_seq_len=2048)


def llama2_7b() -> ModelConfig:
    return ModelConfig(name="llama2-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                       ffn_dim=11008, max_seq_len=4096)


def llama3_8b() -> ModelConfig:
    return ModelConfig(name="llama3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192)


def qwen25_14b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-14b", vocab_size=152064, d_model=5120, n_layers=48, n_heads=40,
                       n_kv_heads=8, ffn_dim=13824, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
                       max_seq_len=32768)


def qwen25_32b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-32b", vocab_size=152064, d_model=5120, n_layers=64, n_heads=40,
                       n_kv_heads=8, ffn_dim=27648, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
                       max_seq_len=32768)


def qwen25_72b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-72b", vocab_size=152064, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, ffn_dim=29568, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
                       max_seq_len=32768)


def llama3_70b() -> ModelConfig:
    return ModelConfig(name="llama3-70b", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192)


def dense_120b() -> ModelConfig:
    return ModelConfig(name="dense-120b", vocab_size=128256, d_model=12288, n_layers=76, n_heads=96,
                       n_kv_heads=8, ffn_dim=32768, rope_theta=500000.0, max_seq_len=8192)


def dense_150b() -> ModelConfig:
    return ModelConfig(name="dense-150b", vocab_size=128256, d_model=12288, n_layers=96, n_heads=96,
                       n_kv_heads=8, ffn_dim=32768, rope_theta=500000.0, max_seq_len=8192)


def moe_tiny() -> ModelConfig:
    return ModelConfig(name="moe-tiny", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_dim=352, max_seq_len=1024,
                       moe=MoEConfig(n_experts=8, expert_dim=128, momentum=0.99, warmup_steps=10))


def et_d12() -> ModelConfig:
    return ModelConfig(name="et-d12", vocab_size=65536, d_model=768, n_layers=12, n_heads=6, n_kv_heads=2,
                       ffn_dim=2048, qk_norm=True, max_seq_len=2048, moe=MoEConfig())


def et_d20() -> ModelConfig:
    return ModelConfig(name="et-d20", vocab_size=65536, d_model=1280, n_layers=20, n_heads=10,
                       ffn_dim=3456, qk_norm=True, max_seq_len=2048, moe=MoEConfig())


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "small": small,
    "125m": gpt_125m,
    "455m": gpt_455m,
    "1b": gpt_1b,
    "llama2-7b": llama2_7b,
    "llama3-8b": llama3_8b,
    "qwen2.5-14b": qwen25_14b,
    "qwen2.5-32b": qwen25_32b,
    "qwen2.5-72b": qwen25_72b,
    "llama3-70b": llama3_70b,
    "dense-120b": dense_120b,
    "dense-150b": dense_150b,
    "moe-tiny": moe_tiny,
    "et-d12": et_d12,
    "et-d20": et_d20,
}


MAX_CONFIG_BYTES = 1 << 20


class ConfigError(ValueError):
    """A model config that cannot be used; the message names the cause and the fix."""


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)} "
                          "(or a Hugging Face model folder, or a path to a .json/.toml config file)") from None


def load_model_config(name_or_path: str | Path | ModelConfig) -> ModelConfig:
    """A preset by name, a Hugging Face model folder (its config.json, models/hf.py), or a config from a
    JSON/TOML file (a `base = "preset"` key overrides a preset)."""
    if isinstance(name_or_path, ModelConfig):
        return name_or_path
    text = str(name_or_path)
    if text in PRESETS:
        return preset(text)
    path = Path(text)
    if path.is_dir():
        from .hf import config_from_dir

        return config_from_dir(path)
    if path.suffix.lower() not in (".json", ".toml"):
        return preset(text)
    data = read_structured(path, MAX_CONFIG_BYTES, "a model config", ConfigError, "write the model config as "
                           "an object of fields, e.g. {\"base\": \"tiny\", \"n_layers\": 8}")
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} must hold an object of fields, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    base = data.pop("base", None)
    if base is not None:
        data = {**preset(str(base)).model_dump(), **data}
    return config_from_dict(data, source=str(path))


def config_from_dict(data: dict, source: str = "config") -> ModelConfig:
    """Validate a dict into a ModelConfig, turning pydantic's report into one line."""
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {one_line(e)}") from None
