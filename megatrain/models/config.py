"""ModelConfig (and its MoEConfig): the validated description of a LLaMA-style decoder (docs/DESIGN.md 4.1).

Where it sits: presets.py returns these; units.py and eager.py build unit templates and the eager model from them;
ir.trace() records them in the ModelIR. Errors name the field and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .depth.spec import FORMS, parse_depth

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


ROUTERS = ("et", "tc", "ec")
GATES = ("sigmoid", "softmax")
MLPS = ("relu2", "swiglu")
BALANCES = ("aux", "bias", "none")
EC_EVALS = ("threshold", "topk")


class MoEConfig(BaseModel):
    """Routed experts in every block's feed-forward (but the first, with dense_first). Defaults: the ET paper's."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    router: str = Field("et", description="et (expert threshold), tc (token choice top-k) or ec (expert "
                        "choice top-k over the micro-batch in training; see ec_eval for inference)")
    n_experts: int = Field(16, description="routed experts E")
    top_k: int = Field(1, description="routed experts per token: exactly for tc, on average for et and ec "
                       "(each expert takes k = ceil(tokens x top_k / E) tokens)")
    expert_dim: int | None = Field(None, description="hidden width of each expert (default 2 x d_model)")
    expert_mlp: str = Field("relu2", description="expert MLP: relu2 (ReLU squared) or swiglu")
    shared_expert: bool = Field(True, description="one always-on expert of the same type and width")
    dense_first: bool = Field(True, description="block 0 keeps the dense SwiGLU MLP of width ffn_dim")
    gate: str = Field("sigmoid", description="expert weight: sigmoid of its logit, or softmax over the experts")
    balance: str = Field("none", description="tc only: aux (Switch loss), bias (DeepSeek loss-free bias) or none")
    aux_loss_coef: float = Field(1e-3, description="tc aux: alpha in alpha * E * sum_i f_i P_i")
    bias_rate: float = Field(5e-3, description="tc bias: u in b_i += u * sign(mean load - load_i) per step")
    momentum: float = Field(0.999, description="et and ec: EMA momentum beta of the per-step cutoffs")
    warmup_steps: int = Field(4000, description="et: optimizer steps routed by expert choice before thresholds")
    capacity_factor: float = Field(0.5, description="et training: each expert takes between (1-C)k and (1+C)k "
                                   "tokens")
    ec_eval: str = Field("threshold", description="ec at inference: threshold (r >= its own EMA cutoff, "
                         "causal, as the ET paper evaluates EC) or topk (top-k over the micro-batch: non-causal)")

    @field_validator("router", "gate", "expert_mlp", "balance", "ec_eval")
    @classmethod
    def _choice(cls, v: str, info: Any) -> str:
        valid = {"router": ROUTERS, "gate": GATES, "expert_mlp": MLPS, "balance": BALANCES,
                 "ec_eval": EC_EVALS}[info.field_name]
        if v not in valid:
            raise ValueError(f"{info.field_name} {v!r} is not one of {', '.join(valid)}; pick one of them")
        return v

    @field_validator("n_experts", "top_k")
    @classmethod
    def _at_least_one(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}; use at least one")
        return v

    @field_validator("expert_dim")
    @classmethod
    def _width(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"expert_dim must be a positive integer or omitted (= 2 x d_model), got {v}")
        return v

    @field_validator("capacity_factor", "aux_loss_coef", "bias_rate", "warmup_steps")
    @classmethod
    def _non_negative(cls, v: float, info: Any) -> float:
        if v < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {v}; use 0 to turn it off")
        return v

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"momentum must be in [0, 1), got {v}; the paper uses 0.999")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}; lower top_k or add experts")
        if self.balance != "none" and self.router != "tc":
            raise ValueError(f"balance={self.balance!r} applies to router 'tc' only; set balance to 'none' for "
                             f"router {self.router!r}")
        return self

    # -- sizes ---------------------------------------------------------------------------------------------
    def width(self, d_model: int) -> int:
        return self.expert_dim if self.expert_dim is not None else 2 * d_model

    def expert_params(self, d_model: int) -> int:
        return (3 if self.expert_mlp == "swiglu" else 2) * d_model * self.width(d_model)

    def ffn_params(self, d_model: int) -> int:
        """Parameters of one MoE feed-forward: router, routed experts, shared expert."""
        return d_model * self.n_experts + (self.n_experts + self.shared_expert) * self.expert_params(d_model)

    def layers(self, n_layers: int) -> range:
        """The blocks whose feed-forward is an MoE."""
        return range(1 if self.dense_first else 0, n_layers)


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
    depth_mixing: str = Field("residual", description="how sub-layers read and write the depth state: " + FORMS)
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
        d, hd = self.d_model, self.head_dim
        q, kv = self.n_heads * hd, self.kv_heads * hd
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        ffn = 3 * d * self.ffn_dim
        block = attn + ffn + 2 * d
        embed = self.vocab_size * d
        dense = embed + self.n_layers * block + d + (0 if self.tie_embeddings else embed)
        moe = 0 if self.moe is None else len(self.moe.layers(self.n_layers)) * (self.moe.ffn_params(d) - ffn)
        return dense + moe + parse_depth(self.depth_mixing).n_params(self.n_layers, d)


def _divisors(n: int, limit: int = 8) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0][:limit]


def one_line(e: ValidationError) -> str:
    """The first validation problem as `field: message`."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "config"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        nested = err["loc"][:1] == ("moe",) and len(err["loc"]) > 1
        msg = f"unknown field; valid fields: {', '.join((MoEConfig if nested else ModelConfig).model_fields)}"
    elif err["type"] == "missing":
        msg = "required field is missing"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"
