"""ModelConfig: the validated description of a LLaMA-style decoder (docs/DESIGN.md 4.1).

Where it sits: presets.py returns these; transformer.py builds unit templates and the eager model from them;
ir.trace() records them in the ModelIR. Errors name the field and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .depth.spec import parse_depth
from .moe import MoEConfig

MAX_TENSOR_NUMEL = 2**36  # 64G elements: 128 GiB in bf16, more than any GPU holds as one unit's weight
MAX_LAYERS = 4096


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling (Hugging Face `rope_type: llama3`): wavelengths longer than
    original_max_position / low_freq_factor are divided by `factor`, shorter than original / high_freq_factor
    kept, and those between interpolated smoothly."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    type: Literal["llama3"] = Field("llama3", description="the only scaling implemented: llama3")
    factor: float = Field(gt=0, description="how much longer the context is than the original")
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position: int = Field(gt=0, description="the context length the model was pre-trained at")

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling: high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")
        return self


class ModelConfig(BaseModel):
    """A decoder-only transformer: embed, `n_layers` blocks, head (final norm, LM head, loss)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field("custom", description="a label for tables and file names")
    vocab_size: int = Field(description="token vocabulary size")
    d_model: int = Field(description="hidden width")
    n_layers: int = Field(description="number of transformer blocks")
    n_heads: int = Field(description="attention query heads")
    n_kv_heads: int | None = Field(None, description="key/value heads for grouped-query attention (default: n_heads)")
    ffn_dim: int = Field(description="SwiGLU hidden width")
    head_size: int | None = Field(None, description="width of one attention head (default: d_model / n_heads; "
                                  "Qwen3 and some Llamas set it apart)")
    rope_theta: float = Field(10000.0, description="RoPE base frequency")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (Llama 3.1's llama3 type)")
    sliding_window: int | None = Field(None, description="attention window of the source model (Mistral); "
                                       "megatrain runs full causal attention, so seq_len must not exceed it")
    norm_eps: float = Field(1e-5, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="the LM head shares the token embedding matrix")
    qkv_bias: bool = Field(False, description="biases on the q, k, v projections (Qwen2)")
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys per head (Qwen3, OLMo2)")
    max_seq_len: int = Field(4096, description="longest sequence the model is configured for")
    init_std: float = Field(0.02, description="standard deviation of the normal weight init")
    depth_mixing: str = Field("residual", description="how sub-layers read and write the depth state: residual, "
                              "denseformer[:KxP], hc[:n], hc-dynamic[:n], attnres[:NB] or depthssd[:N]")
    moe: MoEConfig | None = Field(None, description="mixture-of-experts feed-forward (models/moe.py); None: dense")

    @field_validator("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_size",
                     "sliding_window", "max_seq_len", mode="before")
    @classmethod
    def _not_a_bool(cls, v: Any, info: Any) -> Any:
        if isinstance(v, bool):  # pydantic would read true as 1
            raise ValueError(f"{info.field_name} must be an integer, got {str(v).lower()}")
        return v

    @field_validator("head_size", "sliding_window")
    @classmethod
    def _positive_or_none(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"{info.field_name} must be a positive integer or omitted, got {v}")
        return v

    @field_validator("vocab_size", "d_model", "n_layers", "n_heads", "ffn_dim", "max_seq_len")
    @classmethod
    def _positive(cls, v: int, info: Any) -> int:
        if v <= 0:
            raise ValueError(f"{info.field_name} must be a positive integer, got {v}")
        return v

    @field_validator("depth_mixing")
    @classmethod
    def _depth_spec(cls, v: str) -> str:
        return str(parse_depth(v))

    @field_validator("n_kv_heads")
    @classmethod
    def _kv_positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"n_kv_heads must be a positive integer or omitted (= n_heads), got {v}")
        return v

    @field_validator("rope_theta", "norm_eps", "init_std")
    @classmethod
    def _positive_float(cls, v: float, info: Any) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name} must be > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _shapes_divide(self) -> ModelConfig:
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must divide d_model={self.d_model}; "
                f"pick n_heads among {_divisors(self.d_model)}"
            )
        if self.kv_heads > self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.kv_heads} must divide n_heads={self.n_heads}; "
                f"pick n_kv_heads among {_divisors(self.n_heads)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {'head_size' if self.head_size else 'd_model / n_heads'} = {self.head_dim} "
                             "must be even for RoPE")
        largest = max(self.vocab_size, self.ffn_dim, self.d_model) * self.d_model
        if largest > MAX_TENSOR_NUMEL:
            raise ValueError(f"a weight of {largest:,} elements exceeds {MAX_TENSOR_NUMEL:,}, the most one unit "
                             "can stream; reduce d_model, ffn_dim or vocab_size")
        if self.moe is not None:
            self._check_moe(self.moe)
        if self.n_layers > MAX_LAYERS:
            raise ValueError(f"n_layers={self.n_layers} exceeds {MAX_LAYERS}, the most the planner schedules; "
                             "use fewer, wider layers")
        return self

    def _check_moe(self, moe: MoEConfig) -> None:
        if not moe.layers(self.n_layers):
            raise ValueError("moe.dense_first leaves no MoE block in a 1-layer model; set moe.dense_first to "
                             "false or add layers")
        stacked = moe.n_experts * moe.width(self.d_model) * self.d_model
        if stacked > MAX_TENSOR_NUMEL:
            raise ValueError(f"the stacked expert weights hold {stacked:,} elements, more than {MAX_TENSOR_NUMEL:,} "
                             "one unit can stream; use fewer or narrower experts (moe.n_experts, moe.expert_dim)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.d_model // self.n_heads

    def n_params(self) -> int:
        """Analytic parameter count (the traced count must agree)."""
        from . import depth

        d, hd = self.d_model, self.head_dim
        q, kv = self.n_heads * hd, self.kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        ffn = 3 * d * self.ffn_dim
        block = attn + ffn + 2 * d
        embed = self.vocab_size * d
        dense = embed + self.n_layers * block + d + (0 if self.tie_embeddings else embed)
        moe = 0 if self.moe is None else len(self.moe.layers(self.n_layers)) * (self.moe.ffn_params(d) - ffn)
        return dense + moe + depth.n_params(self)


def _divisors(n: int, limit: int = 8) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0][:limit]
