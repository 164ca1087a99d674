"""Synthetic ModelIRs, built from formulas or from explicit per-unit numbers, with no torch and no tracing.

Where it sits: tests and benchmarks of the planner (tests/planner/, the hypothesis property tests) and
`tune()` on synthetic models. Real models come from `megatrain.ir.trace`.
Try it: `python -c "from megatrain.planner.synthetic import transformer_ir; print(transformer_ir().units[1])"`.

`transformer_ir` uses LLaMA-shaped formulas (matmul FLOPs 2 x tokens x weights plus attention, saved bytes
and transient peaks as multiples of tokens x width); they are plausible, not measured. `build_ir` takes
every number explicitly, which is what property tests want: carries may change size along depth (DepthSSD
states, DenseFormer stacks) and nothing is assumed uniform.
"""

from __future__ import annotations

from megatrain.ir.base import dtype_bytes
from megatrain.ir.model_ir import ModelIR, ParamSlice, TensorSpec, UnitIR


def _unit(name: str, index: int, kind: str, flat: int, carry_in: int, carry_out: int, flops_fwd: int,
          flops_bwd: int, saved: int, peak_fwd: int, peak_bwd: int, tied: dict | None = None) -> UnitIR:
    def spec(tag: str, nbytes: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec(name=f"{name}.{tag}", shape=(nbytes,), dtype="uint8"),) if nbytes else ()

    return UnitIR(name=name, index=index, kind=kind, template=kind,
                  params=(ParamSlice(name="weight", shape=(flat,), offset=0, numel=flat),), flat_numel=flat,
                  tied=tied or {}, carry_in=spec("in0", carry_in), carry_out=spec("out0", carry_out),
                  flops_fwd=flops_fwd, flops_bwd=flops_bwd, saved_bytes=saved, peak_fwd_bytes=peak_fwd,
                  peak_bwd_bytes=peak_bwd, graph_nodes={"embed": 4, "block": 60, "head": 20}[kind])


def build_ir(units: list[dict], *, name: str = "synthetic", micro_batch: int = 1, seq_len: int = 128,
             dtype: str = "bfloat16", resident_bytes: int = 0, tied: bool = False,
             config: dict | None = None, target: str = "cuda") -> ModelIR:
    """A ModelIR from explicit numbers. `units[k]` has flat_numel, carry_out (bytes of its output carry),
    flops_fwd, flops_bwd, saved_bytes, peak_fwd_bytes, peak_bwd_bytes. The first unit is the embed (no
    carry-in), the last the head (its output is a 4-byte loss); each carry-in is the previous carry-out."""
    n = len(units)
    if n < 2:
        raise ValueError("a synthetic model needs at least an embed and a head")
    out: list[UnitIR] = []
    for k, u in enumerate(units):
        kind = "embed" if k == 0 else ("head" if k == n - 1 else "block")
        nm = "embed" if k == 0 else ("head" if k == n - 1 else f"blocks.{k - 1}")
        carry_in = units[k - 1]["carry_out"] if k else 0
        carry_out = 4 if k == n - 1 else u["carry_out"]
        tie = {"weight": "embed.weight"} if tied and k == n - 1 else None
        out.append(_unit(nm, k, kind, u["flat_numel"], carry_in, carry_out, u["flops_fwd"], u["flops_bwd"],
                         u["saved_bytes"], u["peak_fwd_bytes"], u["peak_bwd_bytes"], tie))
    resident = (TensorSpec(name="rope.cos", shape=(resident_bytes,), dtype="uint8"),) if resident_bytes else ()
    names = [u.name for u in out]
    edges = [(a, b, "carry") for a, b in zip(names, names[1:])]
    if tied:
        edges.append(("embed", "head", "tied"))
    return ModelIR(model=name, config=config or {"synthetic": "explicit"}, micro_batch=micro_batch,
                   seq_len=seq_len, dtype=dtype, target=target, units=tuple(out), resident=resident,
                   edges=tuple(edges))


def transformer_ir(n_layers: int = 4, d_model: int = 128, ffn_dim: int = 352, vocab: int = 256,
                   n_heads: int = 4, n_kv_heads: int | None = None, seq_len: int = 128, micro_batch: int = 1,
                   dtype: str = "bfloat16", tied: bool = False, name: str = "synthetic",
                   target: str = "cuda") -> ModelIR:
    """A LLaMA-shaped ModelIR from formulas (defaults: the dims of the `tiny` preset)."""
    params = dict(n_layers=n_layers, d_model=d_model, ffn_dim=ffn_dim, vocab=vocab, n_heads=n_heads,
                  n_kv_heads=n_kv_heads, seq_len=seq_len, dtype=dtype, tied=tied, name=name, target=target)
    db = dtype_bytes(dtype)
    d, f, v = d_model, ffn_dim, vocab
    kv = (n_kv_heads or n_heads) * (d // n_heads)
    tokens = micro_batch * seq_len
    act = tokens * d * db
    block_w = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    attn = 4 * micro_batch * seq_len * seq_len * d
    block_fwd = 2 * tokens * (block_w - 2 * d) + attn
    block_saved = tokens * db * (6 * d + 2 * kv + 4 * f)
    head_w = d + v * d
    chunk = min(tokens, 1024)
    units = [dict(flat_numel=v * d, carry_out=act, flops_fwd=0, flops_bwd=0, saved_bytes=0,
                  peak_fwd_bytes=act, peak_bwd_bytes=act + v * d * db)]
    units += [dict(flat_numel=block_w, carry_out=act, flops_fwd=block_fwd, flops_bwd=2 * block_fwd,
                   saved_bytes=block_saved, peak_fwd_bytes=act + tokens * db * (3 * d + 2 * f),
                   peak_bwd_bytes=block_saved + block_w * db + 2 * act + tokens * db * 2 * f)
              for _ in range(n_layers)]
    head_fwd = 2 * tokens * v * d
    units.append(dict(flat_numel=head_w, carry_out=4, flops_fwd=head_fwd, flops_bwd=2 * head_fwd,
                      saved_bytes=act + chunk * v * 4, peak_fwd_bytes=act + chunk * v * 4 * 2,
                      peak_bwd_bytes=2 * act + head_w * db + chunk * v * 4 * 3))
    return build_ir(units, name=name, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
                    resident_bytes=2 * seq_len * (d // n_heads) * db, tied=tied, config={"synthetic": params},
                    target=target)


def rebuild(ir: ModelIR, micro_batch: int) -> ModelIR:
    """The same synthetic transformer at another micro-batch (what `tune` needs); explicit ones can't."""
    params = ir.config.get("synthetic")
    if not isinstance(params, dict):
        raise ValueError(f"model {ir.model!r} was built from explicit numbers; pass a ModelIR per micro-batch")
    return transformer_ir(**params, micro_batch=micro_batch)
