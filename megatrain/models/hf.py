"""Hugging Face model folders: config.json to ModelConfig and back, and the tensor names of each side.

Where it sits: `load_model_config(DIR)` (presets.py) maps a Hugging Face model folder's config.json here, so
`--model DIR` works for inspect, plan, tune, compile and train with config.json alone; the runtime loads the
folder's safetensors weights by `our_name` (runtime/hf_load.py) and `megatrain export --out DIR` writes
config.json (`hf_config`) and tensors under `hf_name` (runtime/export.py). Try it:
`python -c "from megatrain.models.hf import config_from_hf; help(config_from_hf)"`.

Families: LlamaForCausalLM (Llama 2, 3, 3.1 with `rope_scaling` of type llama3), Qwen2ForCausalLM (Qwen2.5:
biases on q, k, v), Qwen3ForCausalLM (per-head RMSNorm on q and k), MistralForCausalLM (its sliding window
must not be in effect: seq_len <= window). Every config.json field is mapped explicitly: fields that set the
model's math become ModelConfig fields; fields with no effect on training (token ids, dtype, generation
defaults) are listed in HARMLESS; a field that changes the math in a way megatrain does not implement (another
RoPE type, a bias on o_proj or the MLP, an activation other than SiLU, dropout, quantization, custom code)
and any field this module does not know are refused in one line naming the field. Nothing is approximated. A
field the file leaves out takes transformers' default for its family, which is not one rule: Qwen3's head_dim
is 128, Mistral's window (and Qwen's, with use_sliding_window) 4096 tokens, an absent num_key_value_heads 32
for Qwen and 8 for Mistral where a null one is the number of heads, llama3 RoPE's original context length
max_position_embeddings (tests/runtime/test_hf.py compares each with transformers' config classes).
Both config formats are read: transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5
(`rope_parameters`, `dtype`); `hf_config` writes both, so either version loads an export without a warning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .config import ModelConfig, RopeScaling, one_line

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 4 * 2**20

FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "MistralForCausalLM": "mistral"}
ARCHITECTURE = {v: k for k, v in FAMILIES.items()}
# transformers' defaults for the fields a config.json may omit (LlamaConfig, Qwen2Config, ...)
DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072}
DEFAULT_KV_HEADS = {"qwen2": 32, "qwen3": 32, "mistral": 8}  # when num_key_value_heads is absent (null, or llama: = heads)
DEFAULT_HEAD_DIM = {"qwen3": 128}  # when head_dim is absent (null, or another family: hidden_size / heads)
DEFAULT_WINDOW = 4096  # Mistral's and Qwen's sliding_window when the key is absent (Qwen: only with use_sliding_window)
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
MAPPED = frozenset({
    *REQUIRED, "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "initializer_range", "hidden_act", "attention_bias",
    "mlp_bias", "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "pretraining_tp", "use_mrope", "quantization_config", "auto_map", "architectures", "model_type",
})
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Fields with no effect on the model's math in training: token ids (kept for export), dtype, caching,
# output switches, generation defaults of old configs, labels of classification heads, tool bookkeeping.
HARMLESS = frozenset({
    *TOKEN_IDS, "transformers_version", "torch_dtype", "dtype", "use_cache", "_name_or_path", "name_or_path",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "id2label",
    "label2id", "num_labels", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "pruned_heads", "tf_legacy_loss", "use_bfloat16",
    "decoder_start_token_id", "sep_token_id", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "_attn_implementation_autoset", "attn_implementation", "_attn_implementation",
    "unsloth_fixed", "unsloth_version", "_from_model_config", "embd_pdrop", "resid_pdrop",
})
# fields read as true or false: a JSON boolean (or null, the default) only; "false" in quotes would read as true
BOOLEANS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_mrope")
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings"}


class HFConfigError(ValueError):
    """A Hugging Face config megatrain cannot train exactly; the message names the field and the fix."""


def read_json(path: Path, what: str, cap: int = MAX_CONFIG_BYTES) -> dict:
    """A JSON object from a regular file of at most `cap` bytes, or one line naming the file and the fix."""
    if not path.is_file():
        raise HFConfigError(f"{path}: not a regular file; {what}")
    size = path.stat().st_size
    if size > cap:
        raise HFConfigError(f"{path}: {size:,} bytes is more than a {what.split(';')[0]} holds ({cap:,} at most)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError, MemoryError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HFConfigError(f"{path}: not valid JSON ({type(e).__name__}); {what}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: must hold a JSON object, got {type(data).__name__}; {what}")
    return data


def config_from_dir(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model folder, from its config.json alone (no weights needed)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.exists():
        raise HFConfigError(f"{folder}: a folder without {CONFIG_FILE} is not a Hugging Face model; pass a model "
                            "folder (config.json and *.safetensors), a preset name, or a .json/.toml config file")
    raw = read_json(path, "expected the config.json of a Hugging Face model")
    return config_from_hf(raw, name=folder.resolve().name, source=str(path))


def family_of(raw: dict, source: str = CONFIG_FILE) -> str:
    archs = raw.get("architectures")
    if archs is None and raw.get("model_type") in ARCHITECTURE:
        return raw["model_type"]
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise HFConfigError(f"{source}: architectures must list one model class, got {archs!r}")
    if archs[0] not in FAMILIES:
        raise HFConfigError(f"{source}: architectures {archs[0]!r} is not supported; megatrain trains "
                            f"{', '.join(FAMILIES)}")
    return FAMILIES[archs[0]]


def config_from_hf(raw: dict, name: str = "hf", source: str = CONFIG_FILE) -> ModelConfig:
    """Map a Hugging Face config (config.json as a dict) to a ModelConfig, refusing what is not exact."""
    family = family_of(raw, source)

    def refuse(field: str, why: str) -> HFConfigError:
        return HFConfigError(f"{source}: {field}: {why}")

    unknown = sorted(k for k in raw if k not in MAPPED and k not in HARMLESS)
    if unknown:
        raise refuse(unknown[0], f"unknown field{' (and ' + str(len(unknown) - 1) + ' more)' if len(unknown) > 1 else ''}"
                     "; megatrain cannot tell whether it changes the model's math, so it does not train it")
    for field in REQUIRED:
        if not isinstance(raw.get(field), int) or isinstance(raw.get(field), bool):
            raise refuse(field, f"required integer field is {'missing' if field not in raw else repr(raw[field])}")
    for field in BOOLEANS:
        if raw.get(field) is not None and not isinstance(raw[field], bool):
            raise refuse(field, f"expected true or false, got {raw[field]!r}; write a JSON boolean, "
                         "without quotes")
    if raw.get("model_type") not in (None, family):
        raise refuse("model_type", f"{raw['model_type']!r} does not match architectures ({ARCHITECTURE[family]})")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise refuse("hidden_act", f"{act!r} is not implemented; megatrain's MLP is SwiGLU with SiLU")
    if raw.get("mlp_bias"):
        raise refuse("mlp_bias", "biases in the MLP are not implemented")
    if raw.get("attention_bias") and family != "qwen2":  # Qwen2's q, k, v always have biases: it ignores the field
        raise refuse("attention_bias", "true adds a bias to o_proj as well as q, k, v, which megatrain does "
                     "not implement")
    if raw.get("attention_dropout"):
        raise refuse("attention_dropout", f"{raw['attention_dropout']} > 0: dropout is not implemented; set it "
                     "to 0.0 in config.json to fine-tune without dropout (as most recipes do)")
    if raw.get("use_mrope"):
        raise refuse("use_mrope", "multimodal RoPE is not implemented")
    if raw.get("quantization_config") is not None:
        raise refuse("quantization_config", "quantized weights are not trained; use the full-precision model")
    if raw.get("auto_map") is not None:
        raise refuse("auto_map", "the folder ships its own modelling code, which megatrain does not run")
    tp = raw.get("pretraining_tp", 1)  # > 1 only splits Llama's matmuls in transformers 4: the same function
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise refuse("pretraining_tp", f"expected a positive integer, got {tp!r}")
    heads, d = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim", DEFAULT_HEAD_DIM.get(family))
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0):
        raise refuse("head_dim", f"expected a positive integer, got {head_dim!r}")
    theta, scaling = _rope(raw, refuse, raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[family]))
    kv_heads = raw.get("num_key_value_heads", DEFAULT_KV_HEADS.get(family))
    fields: dict[str, Any] = dict(
        name=name, vocab_size=raw["vocab_size"], d_model=d, n_layers=raw["num_hidden_layers"], n_heads=heads,
        n_kv_heads=heads if kv_heads is None else kv_heads, ffn_dim=raw["intermediate_size"], rope_theta=theta,
        rope_scaling=scaling, norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)), qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", max_seq_len=raw.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[family]),
        init_std=raw.get("initializer_range", 0.02), sliding_window=_window(raw, family, refuse),
        head_size=head_dim if head_dim is not None and head_dim * heads != d else None)
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        raise HFConfigError(f"{source}: {one_line(e)}") from None


def _rope(raw: dict, refuse, max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either config format; llama3's original context length
    defaults to `max_positions` (max_position_embeddings), as transformers 5 fills it."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise refuse(field, f"expected an object, got {value!r}")
    if params is not None:  # transformers 5; a config may carry the version 4 fields too: they must agree
        if theta is not None and params.get("rope_theta", theta) != theta:
            raise refuse("rope_parameters.rope_theta", f"{params['rope_theta']} disagrees with rope_theta {theta}")
        theta = params.get("rope_theta", theta)
        for key, value in (scaling or {}).items():
            mine = params.get("rope_type", params.get("type")) if key in ("type", "rope_type") else params.get(key)
            if mine != value:
                raise refuse(f"rope_scaling.{key}", f"{value!r} disagrees with rope_parameters ({mine!r})")
        scaling = params
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise refuse("rope_theta", f"expected a positive number, got {theta!r}")
    if scaling is None:
        return float(theta), None
    field = "rope_parameters" if params is not None else "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        extra = sorted(set(scaling) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise refuse(f"{field}.{extra[0]}", "is not used by default RoPE; refused rather than ignored")
        return float(theta), None
    if kind != "llama3":
        raise refuse(f"{field}.rope_type", f"{kind!r} is not implemented; megatrain implements default and llama3 "
                     "RoPE")
    extra = sorted(set(scaling) - _ROPE_KEYS)
    if extra:
        raise refuse(f"{field}.{extra[0]}", "is not part of llama3 RoPE scaling")
    try:
        return float(theta), RopeScaling(
            factor=scaling.get("factor"), low_freq_factor=scaling.get("low_freq_factor"),
            high_freq_factor=scaling.get("high_freq_factor"),
            original_max_position=scaling.get("original_max_position_embeddings", max_positions))
    except ValidationError as e:
        err = e.errors()[0]
        raise refuse(f"{field}.{err['loc'][0] if err['loc'] else 'llama3'}", err["msg"].removeprefix("Value error, ")
                     ) from None


def _window(raw: dict, family: str, refuse) -> int | None:
    """The attention window that applies to some layer, or None when every layer attends fully."""
    window = raw.get("sliding_window", DEFAULT_WINDOW)
    if family == "mistral":
        used = window is not None
    elif family in ("qwen2", "qwen3"):
        # transformers: the window is sliding_window (4096 if absent) with use_sliding_window, else none at all
        slides = bool(raw.get("use_sliding_window"))
        types = raw.get("layer_types")
        if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            raise refuse("layer_types", f"expected a list of strings, got {types!r}")
        bad = sorted({t for t in types or () if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise refuse("layer_types", f"{bad[0]!r} is not an attention type megatrain knows")
        if types is not None:
            used = "sliding_attention" in types
            if used and not slides:
                raise refuse("layer_types", "names sliding_attention layers while use_sliding_window is false, "
                             "which leaves them no window (transformers refuses it too); set use_sliding_window "
                             "to true or make every layer full_attention")
        else:  # transformers: layers from max_window_layers on slide when use_sliding_window is set
            first = raw.get("max_window_layers", 28)
            used = slides and window is not None and isinstance(first, int) and first < raw["num_hidden_layers"]
    else:
        used = False
        if raw.get("sliding_window") is not None:
            raise refuse("sliding_window", f"is not a field of {ARCHITECTURE[family]}")
    if not used:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise refuse("sliding_window", f"a sliding window is in use but its size is {window!r}")
    return window


# -- the other direction ---------------------------------------------------------------------------------------
def family_for(config: ModelConfig) -> str:
    """The Hugging Face family that computes what `config` computes, or HFConfigError naming why none does."""
    why = ("depth mixing " + config.depth_mixing if config.depth_mixing != "residual" else
           "mixture-of-experts feed-forward" if config.moe is not None else
           "qk_norm together with qkv_bias" if config.qk_norm and config.qkv_bias else None)
    if why:
        raise HFConfigError(f"{config.name}: a model with {why} has no Hugging Face equivalent; export it with "
                            "--names megatrain (a safetensors file of megatrain's names)")
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def hf_config(config: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """config.json for `config`: the imported folder's own config (`base`) with every math field set from
    `config`, or a complete one for its family. `dtype` ("float32", "bfloat16") is what the shards hold."""
    family = FAMILIES[base["architectures"][0]] if base and base.get("architectures") else family_for(config)
    if base is None:
        family_for(config)  # refuses what no family computes
    out = dict(base or {})
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        r = config.rope_scaling
        rope = {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_position,
                "rope_theta": config.rope_theta}
    out.update({
        "architectures": [ARCHITECTURE[family]], "model_type": family, "vocab_size": config.vocab_size,
        "hidden_size": config.d_model, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings, "initializer_range": config.init_std,
        "attention_dropout": 0.0, "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope, "torch_dtype": dtype, "dtype": dtype, "use_cache": True})
    if family != "qwen2":
        out.setdefault("attention_bias", False)
    if family in ("llama", "mistral"):
        out.setdefault("mlp_bias", False)
    if family == "mistral":
        out["sliding_window"] = config.sliding_window
    if family in ("qwen2", "qwen3"):
        out.setdefault("use_sliding_window", False)
        out.setdefault("sliding_window", None)
        out.setdefault("max_window_layers", config.n_layers)
    for key in TOKEN_IDS:
        out.setdefault(key, None)
    out.pop("_name_or_path", None)
    return dict(sorted(out.items()))


_TO_HF = ((re.compile(r"embed\.(embed_tokens\.weight)"), r"model.\1"),
          (re.compile(r"blocks\.(\d+)\.(.+)"), r"model.layers.\1.\2"),
          (re.compile(r"head\.(norm\.weight)"), r"model.\1"),
          (re.compile(r"head\.(lm_head\.weight)"), r"\1"))
_FROM_HF = ((re.compile(r"model\.(embed_tokens\.weight)"), r"embed.\1"),
            (re.compile(r"model\.layers\.(\d+)\.(.+)"), r"blocks.\1.\2"),
            (re.compile(r"model\.(norm\.weight)"), r"head.\1"),
            (re.compile(r"(lm_head\.weight)"), r"head.\1"))
# buffers old checkpoints saved that hold nothing a model needs (recomputed from the config)
IGNORED = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def hf_name(name: str) -> str:
    """Our parameter name as Hugging Face Llama-family models name it."""
    for pattern, repl in _TO_HF:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    raise HFConfigError(f"parameter {name!r} has no Hugging Face name; export with --names megatrain")


def our_name(name: str) -> str | None:
    """The eager parameter name of a Hugging Face tensor name (None for one that maps to nothing)."""
    for pattern, repl in _FROM_HF:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return None
